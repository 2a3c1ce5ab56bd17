{{/* Several models (`models`): each entry is a pool of engines and workers of its own, behind the
release's gateways and processors. The pool templates render once per scope: the release itself
without `models`, else one scope per model. */}}

{{/* The scopes the pool templates render, appended to `(index . 1).scopes` (include returns text,
so a dict carries them back). A model's scope is the release's with `.Values` as that model sees
it (its model, served name, maxModelLen and storage; its keys of engine, worker and keda in place
of the top-level ones, whole maps included) and `.Model`: its key (the objects' suffix) and
storageSuffix ("-<key>" when it has storage of its own, else "").
Usage: $pools := dict "scopes" (list) ; include "kvmesh.modelScopes" (list . $pools) */}}
{{- define "kvmesh.modelScopes" -}}
{{- $root := index . 0 }}
{{- $out := index . 1 }}
{{- if not $root.Values.models }}
{{- $_ := set $out "scopes" (list $root) }}
{{- else }}
{{- include "kvmesh.checkModels" $root }}
{{- range $entry := $root.Values.models }}
{{- $values := dict }}
{{- range $key, $value := $root.Values }}
{{- $_ := set $values $key $value }}
{{- end }}
{{- range $section := list "engine" "worker" "keda" }}
{{- $merged := dict }}
{{- range $key, $value := get $root.Values $section }}
{{- $_ := set $merged $key $value }}
{{- end }}
{{- range $key, $value := get $entry $section | default dict }}
{{- $_ := set $merged $key $value }}
{{- end }}
{{- $_ := set $values $section $merged }}
{{- end }}
{{- $maxModelLen := ternary (get $entry "maxModelLen") $root.Values.model.maxModelLen (hasKey $entry "maxModelLen") }}
{{- $_ := set $values "model" (dict "name" $entry.model "servedModelName" (get $entry "servedModelName" | default $entry.name)
      "maxModelLen" $maxModelLen "storage" (get $entry "storage" | default $root.Values.model.storage)) }}
{{- $model := dict "key" $entry.name "storageSuffix" (ternary (printf "-%s" $entry.name) "" (hasKey $entry "storage")) }}
{{- $scope := dict "Values" $values "Release" $root.Release "Chart" $root.Chart "Capabilities" $root.Capabilities
      "Template" $root.Template "Files" $root.Files "Model" $model }}
{{- $_ := set $out "scopes" (append $out.scopes $scope) }}
{{- end }}
{{- end }}
{{- end }}

{{/* What the schema cannot say about `models`: unique names and served names, names whose objects
stay apart and whose engines still find their workers, one mount path per volume on the processor. */}}
{{- define "kvmesh.checkModels" -}}
{{- if .Values.disaggregation.enabled }}
{{- fail "models: disaggregation.enabled serves one model; leave models empty or turn disaggregation off" }}
{{- end }}
{{- $names := list }}
{{- $served := list }}
{{- $mounts := list .Values.model.storage.mountPath }}
{{- range $entry := .Values.models }}
{{- if has $entry.name $names }}
{{- fail (printf "models: two entries are named %q; each model needs a name of its own" $entry.name) }}
{{- end }}
{{- /* worker-<name>-<i> (a tensor-parallel group) and engine-<name>-egress would be another model's objects. */}}
{{- range $other := $names }}
{{- range $pair := list (list $other $entry.name) (list $entry.name $other) }}
{{- $rest := trimPrefix (printf "%s-" (first $pair)) (last $pair) }}
{{- if and (ne $rest (last $pair)) (regexMatch "^([0-9]+(-|$)|egress$)" $rest) }}
{{- fail (printf "models: the names %q and %q would name the same objects (worker-%s-<i>, engine-%s-egress); rename one" (first $pair) (last $pair) (first $pair) (first $pair)) }}
{{- end }}
{{- end }}
{{- end }}
{{- $names = append $names $entry.name }}
{{- $servedName := get $entry "servedModelName" | default $entry.name }}
{{- if has $servedName $served }}
{{- fail (printf "models: two entries are served as %q; give each its own servedModelName" $servedName) }}
{{- end }}
{{- $served = append $served $servedName }}
{{- /* The engine finds its worker by its own hostname with -engine- replaced by -worker-, everywhere. */}}
{{- if regexMatch "-engine(-|$)" $entry.name }}
{{- fail (printf "models: the name %q must not contain \"-engine-\" or end in \"-engine\" (an engine finds its worker by its hostname with -engine- replaced by -worker-)" $entry.name) }}
{{- end }}
{{- with get $entry "storage" }}
{{- if has .mountPath $mounts }}
{{- fail (printf "models: model %q mounts its storage at %s, where the processor already mounts another volume; give it a mountPath of its own, or leave storage out to share model.storage" $entry.name .mountPath) }}
{{- end }}
{{- $mounts = append $mounts .mountPath }}
{{- end }}
{{- end }}
{{- end }}

{{/* A pool component's object name: the component's, then the model's key in a model's scope, then
`suffix` if given. Usage: include "kvmesh.poolName" (list $scope "engine" ["egress"]) */}}
{{- define "kvmesh.poolName" -}}
{{- $scope := index . 0 }}
{{- $parts := list (index . 1) }}
{{- with get $scope "Model" }}
{{- if has (index $ 1) (list "engine" "worker") }}
{{- $parts = append $parts .key }}
{{- end }}
{{- end }}
{{- if gt (len .) 2 }}
{{- $parts = append $parts (index . 2) }}
{{- end }}
{{- include "kvmesh.componentName" (list $scope (join "-" $parts)) }}
{{- end }}
