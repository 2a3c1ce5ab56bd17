{{/* LoRA adapters (docs/features/lora.md): vLLM's flags on every component that reads them, and the
volume the adapter folders are mounted from on engines and workers (the engine checks each folder
at start-up, the worker loads it). */}}

{{/* The served name of the release's first model: the base model of an adapter that names none. */}}
{{- define "kvmesh.loraDefaultBase" -}}
{{- if .Values.models }}
{{- $first := first .Values.models }}
{{- get $first "servedModelName" | default $first.name }}
{{- else }}
{{- include "kvmesh.servedModelName" . }}
{{- end }}
{{- end }}

{{/* The --lora-modules entries (vLLM's JSON form) a component takes, one a line: every adapter for
the gateway and processor ("all"), a model scope's own for its engines and workers ("own").
Usage: include "kvmesh.loraModules" (list $scope "own") */}}
{{- define "kvmesh.loraModules" -}}
{{- $scope := index . 0 }}
{{- $lora := $scope.Values.lora }}
{{- $default := include "kvmesh.loraDefaultBase" $scope }}
{{- $own := include "kvmesh.servedModelName" $scope }}
{{- range $adapter := $lora.adapters }}
{{- $base := get $adapter "baseModelName" | default $default }}
{{- $path := ternary $adapter.path (printf "%s/%s" (trimSuffix "/" $lora.storage.mountPath) $adapter.path) (hasPrefix "/" $adapter.path) }}
{{- if eq (index $ 1) "all" }}
{{- $module := dict "name" $adapter.name "path" $path }}
{{- if $scope.Values.models }}
{{- $_ := set $module "base_model_name" $base }}
{{- end }}
{{ $module | toJson }}
{{- else if eq $base $own }}
{{ dict "name" $adapter.name "path" $path | toJson }}
{{- end }}
{{- end }}
{{- end }}

{{/* A component's LoRA flags (nothing with lora.enabled false). `component`: engine, worker,
processor or gateway. Usage: include "kvmesh.loraArgs" (list $scope "engine") */}}
{{- define "kvmesh.loraArgs" -}}
{{- $scope := index . 0 }}
{{- $component := index . 1 }}
{{- $lora := $scope.Values.lora }}
{{- if $lora.enabled }}
- --enable-lora
{{- if has $component (list "engine" "worker") }}
- --max-loras={{ int $lora.maxLoras }}
- --max-lora-rank={{ int $lora.maxLoraRank }}
{{- end }}
{{- if and (eq $component "worker") $lora.maxCpuLoras }}
- --max-cpu-loras={{ int $lora.maxCpuLoras }}
{{- end }}
{{- if and (eq $component "gateway") $lora.allowRuntimeUpdating }}
- --allow-runtime-lora-updating
{{- end }}
{{- range $module := include "kvmesh.loraModules" (list $scope (ternary "own" "all" (has $component (list "engine" "worker")))) | trim | splitList "\n" }}
{{- if $module }}
- {{ printf "--lora-modules=%s" $module | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* The adapters' volume on engines and workers: an existing PVC, or any volume source. */}}
{{- define "kvmesh.loraVolumeMount" -}}
{{- $lora := .Values.lora }}
{{- if and $lora.enabled (or $lora.storage.existingClaim $lora.storage.volume) }}
- name: lora-adapters
  mountPath: {{ $lora.storage.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "kvmesh.loraVolume" -}}
{{- $lora := .Values.lora }}
{{- if and $lora.enabled (or $lora.storage.existingClaim $lora.storage.volume) }}
- name: lora-adapters
{{- if $lora.storage.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ $lora.storage.existingClaim }}
    readOnly: true
{{- else }}
  {{- toYaml $lora.storage.volume | nindent 2 }}
{{- end }}
{{- end }}
{{- end }}
