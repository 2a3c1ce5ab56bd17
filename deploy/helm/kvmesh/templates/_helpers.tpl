{{/* Names, labels and the pieces every kvmesh pod shares. */}}

{{- define "kvmesh.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's full name; component objects are "<fullname>-<component>". */}}
{{- define "kvmesh.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* A component's object name. Usage: include "kvmesh.componentName" (list . "engine") */}}
{{- define "kvmesh.componentName" -}}
{{- $root := index . 0 }}
{{- printf "%s-%s" (include "kvmesh.fullname" $root) (index . 1) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvmesh.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of a component's objects. Usage: include "kvmesh.labels" (list . "engine") */}}
{{- define "kvmesh.labels" -}}
{{- $root := index . 0 -}}
helm.sh/chart: {{ include "kvmesh.chart" $root }}
{{ include "kvmesh.selectorLabels" . }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
{{- end }}

{{/* The labels a component's selectors match (never change them: selectors are immutable). */}}
{{- define "kvmesh.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "kvmesh.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- with get $root "Model" }}
{{- if has (index $ 1) (list "engine" "worker") }}
kvmesh.io/model: {{ .key }}
{{- end }}
{{- end }}
{{- end }}

{{/* Disaggregated prefill/decode: the role label of engine and worker pods (prefill or decode).
Usage: include "kvmesh.roleLabel" "prefill" */}}
{{- define "kvmesh.roleLabel" -}}
kvmesh.io/role: {{ . }}
{{- end }}

{{- define "kvmesh.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvmesh.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The image of a flavour (cpu or cuda). Usage: include "kvmesh.image" (list . "cpu") */}}
{{- define "kvmesh.image" -}}
{{- $root := index . 0 }}
{{- $tag := default $root.Chart.AppVersion $root.Values.image.tag }}
{{- printf "%s:%s-%s" $root.Values.image.repository $tag (index . 1) }}
{{- end }}

{{/* The worker's flavour: cuda with GPUs, cpu without. */}}
{{- define "kvmesh.workerFlavor" -}}
{{- if gt (int .Values.worker.gpus) 0 }}cuda{{ else }}cpu{{ end }}
{{- end }}

{{- define "kvmesh.servedModelName" -}}
{{- default .Values.model.name .Values.model.servedModelName }}
{{- end }}

{{- define "kvmesh.modelClaimName" -}}
{{- default (include "kvmesh.componentName" (list . (include "kvmesh.modelVolumeName" .))) .Values.model.storage.pvc.existingClaim }}
{{- end }}

{{/* The model volume's name in a pod: models, or models-<key> for a model with storage of its own
(the processor mounts it beside the release's). */}}
{{- define "kvmesh.modelVolumeName" -}}
models{{ with get . "Model" }}{{ .storageSuffix }}{{ end }}
{{- end }}

{{/* Empty when no Redis is configured. */}}
{{- define "kvmesh.redisUrl" -}}
{{- if .Values.redis.enabled }}
{{- printf "redis://%s:%d/0" (include "kvmesh.componentName" (list . "redis")) (int .Values.redis.port) }}
{{- else }}
{{- .Values.redis.url }}
{{- end }}
{{- end }}

{{/* Pod-level settings every kvmesh pod shares. Usage: include "kvmesh.podCommon" (list . .Values.engine) */}}
{{- define "kvmesh.podCommon" -}}
{{- $root := index . 0 }}
{{- $component := index . 1 -}}
securityContext:
  {{- toYaml $root.Values.podSecurityContext | nindent 2 }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $component.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $component.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $component.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The model storage volume (workers and processors). */}}
{{- define "kvmesh.modelVolume" -}}
- name: {{ include "kvmesh.modelVolumeName" . }}
  {{- $storage := .Values.model.storage }}
  {{- if eq $storage.type "pvc" }}
  persistentVolumeClaim:
    claimName: {{ include "kvmesh.modelClaimName" . }}
  {{- else if eq $storage.type "hostPath" }}
  hostPath:
    path: {{ $storage.hostPath.path }}
    type: {{ $storage.hostPath.type }}
  {{- else }}
  emptyDir: {}
  {{- end }}
{{- end }}

{{- define "kvmesh.modelVolumeMount" -}}
- name: {{ include "kvmesh.modelVolumeName" . }}
  mountPath: {{ .Values.model.storage.mountPath }}
{{- end }}

{{/* Environment shared by the services that touch models. */}}
{{- define "kvmesh.modelEnv" -}}
- name: KVMESH_CACHE_DIR
  value: {{ .Values.model.storage.cacheDir | quote }}
{{- end }}

{{/* The prefix index for a service whose variables start with `prefix` (engines publish to it,
processors read it); empty without Redis. Usage: include "kvmesh.prefixIndexEnv" (list . "KVMESH_ENGINE") */}}
{{- define "kvmesh.prefixIndexEnv" -}}
{{- $root := index . 0 }}
{{- $prefix := index . 1 }}
{{- with include "kvmesh.redisUrl" $root -}}
- name: {{ $prefix }}_PREFIX_INDEX
  value: {{ . | quote }}
- name: {{ $prefix }}_HEARTBEAT_TTL
  value: {{ $root.Values.redis.heartbeatTtl | toString | quote }}
{{- end }}
{{- end }}

{{/* A component's PodDisruptionBudget. Usage: include "kvmesh.pdb" (list . "engine" .Values.engine) */}}
{{- define "kvmesh.pdb" -}}
{{- $root := index . 0 }}
{{- $name := index . 1 }}
{{- $component := index . 2 }}
{{- if $component.pdb.enabled }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "kvmesh.poolName" (list $root $name) }}
  labels:
    {{- include "kvmesh.labels" (list $root $name) | nindent 4 }}
spec:
  maxUnavailable: {{ $component.pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "kvmesh.selectorLabels" (list $root $name) | nindent 6 }}
{{- end }}
{{- end }}

{{/* A Deployment's CPU HorizontalPodAutoscaler. Usage: include "kvmesh.hpa" (list . "gateway" .Values.gateway) */}}
{{- define "kvmesh.hpa" -}}
{{- $root := index . 0 }}
{{- $name := index . 1 }}
{{- $scaling := (index . 2).autoscaling }}
{{- if $scaling.enabled }}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "kvmesh.componentName" (list $root $name) }}
  labels:
    {{- include "kvmesh.labels" (list $root $name) | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "kvmesh.componentName" (list $root $name) }}
  minReplicas: {{ $scaling.minReplicas }}
  maxReplicas: {{ $scaling.maxReplicas }}
  metrics:
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ $scaling.targetCPUUtilizationPercentage }}
{{- end }}
{{- end }}

{{/* KEDA's ScaledObject for one half of the model replicas (engine or worker StatefulSet): both
get the same trigger and bounds, so the pairs scale together. Usage: include "kvmesh.scaledObject" (list . "engine") */}}
{{- define "kvmesh.scaledObject" -}}
{{- $root := index . 0 }}
{{- $name := index . 1 }}
{{- $keda := $root.Values.keda }}
{{- if $keda.enabled }}
apiVersion: keda.sh/v1alpha1
kind: ScaledObject
metadata:
  name: {{ include "kvmesh.poolName" (list $root $name) }}
  labels:
    {{- include "kvmesh.labels" (list $root $name) | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: StatefulSet
    name: {{ include "kvmesh.poolName" (list $root $name) }}
  minReplicaCount: {{ $keda.minReplicas }}
  maxReplicaCount: {{ $keda.maxReplicas }}
  pollingInterval: {{ $keda.pollingInterval }}
  cooldownPeriod: {{ $keda.cooldownPeriod }}
  triggers:
    - type: prometheus
      metadata:
        serverAddress: {{ $keda.prometheusAddress | quote }}
        query: {{ printf "sum(vllm:num_requests_waiting{namespace=%q,model_name=%q})" $root.Release.Namespace (include "kvmesh.servedModelName" $root) | quote }}
        threshold: {{ $keda.waitingRequestsPerReplica | toString | quote }}
{{- end }}
{{- end }}

{{/* Probe timings (the handler is the template's). */}}
{{- define "kvmesh.readinessTimings" -}}
periodSeconds: 5
timeoutSeconds: 2
failureThreshold: 2
{{- end }}

{{- define "kvmesh.livenessTimings" -}}
periodSeconds: 10
timeoutSeconds: 5
failureThreshold: 3
{{- end }}

{{/* ---- Internal security: the role tokens (always) and mutual TLS (by default) of the gRPC services. */}}

{{- define "kvmesh.internalTokenSecretName" -}}
{{- default (include "kvmesh.componentName" (list . "internal-token")) .Values.internalAuth.existingSecret }}
{{- end }}

{{/* The caller roles whose tokens a component holds: its own, to call with, and its callers', to check.
Usage: include "kvmesh.tokenRoles" "engine" (a space-separated list) */}}
{{- define "kvmesh.tokenRoles" -}}
{{- get (dict "gateway" "gateway" "processor" "gateway processor" "engine" "processor engine" "worker" "engine") . }}
{{- end }}

{{/* The Secret with the mutual-TLS certificate: the user's, or the one the chart makes. */}}
{{- define "kvmesh.tlsSecretName" -}}
{{- default (include "kvmesh.componentName" (list . "internal-tls")) .Values.internalAuth.tls.secretName }}
{{- end }}

{{/* The TLS flags (a service's, and the exec health probe's). */}}
{{- define "kvmesh.tlsArgs" -}}
{{- if .Values.internalAuth.tls.enabled -}}
- --tls-cert-file=/var/run/kvmesh/tls/tls.crt
- --tls-key-file=/var/run/kvmesh/tls/tls.key
- --tls-ca-file=/var/run/kvmesh/tls/ca.crt
- --tls-server-name={{ .Values.internalAuth.tls.serverName }}
{{- end }}
{{- end }}

{{/* Flags of a kvmesh container: the token files (never a token) its component holds, and TLS when
enabled. Usage: include "kvmesh.internalSecurityArgs" (list . "engine") */}}
{{- define "kvmesh.internalSecurityArgs" -}}
{{- $root := index . 0 -}}
{{- if $root.Values.internalAuth.existingSecret }}
- --internal-token-file=/var/run/kvmesh/internal-token/token
{{- else }}
{{- range splitList " " (include "kvmesh.tokenRoles" (index . 1)) }}
- --{{ . }}-token-file=/var/run/kvmesh/{{ . }}-token/token
{{- end }}
{{- end }}
{{- with include "kvmesh.tlsArgs" $root }}
{{ . }}
{{- end }}
{{- end }}

{{/* Usage: include "kvmesh.internalSecurityVolumeMounts" (list . "engine") */}}
{{- define "kvmesh.internalSecurityVolumeMounts" -}}
{{- $root := index . 0 -}}
{{- if $root.Values.internalAuth.existingSecret }}
- name: internal-token
  mountPath: /var/run/kvmesh/internal-token
  readOnly: true
{{- else }}
{{- range splitList " " (include "kvmesh.tokenRoles" (index . 1)) }}
- name: {{ . }}-token
  mountPath: /var/run/kvmesh/{{ . }}-token
  readOnly: true
{{- end }}
{{- end }}
{{- if $root.Values.internalAuth.tls.enabled }}
- name: internal-tls
  mountPath: /var/run/kvmesh/tls
  readOnly: true
{{- end }}
{{- end }}

{{/* Mode 0440: the files belong to root and to the pod's fsGroup (the service's group), readable by nothing else.
Usage: include "kvmesh.internalSecurityVolumes" (list . "engine") */}}
{{- define "kvmesh.internalSecurityVolumes" -}}
{{- $root := index . 0 -}}
{{- if $root.Values.internalAuth.existingSecret }}
- name: internal-token
  secret:
    secretName: {{ include "kvmesh.internalTokenSecretName" $root }}
    defaultMode: 0440
    items:
      - key: {{ $root.Values.internalAuth.key }}
        path: token
{{- else }}
{{- range splitList " " (include "kvmesh.tokenRoles" (index . 1)) }}
- name: {{ . }}-token
  secret:
    secretName: {{ include "kvmesh.componentName" (list $root (printf "%s-token" .)) }}
    defaultMode: 0440
    items:
      - key: token
        path: token
{{- end }}
{{- end }}
{{- if $root.Values.internalAuth.tls.enabled }}
- name: internal-tls
  secret:
    secretName: {{ include "kvmesh.tlsSecretName" $root }}
    defaultMode: 0440
    items:
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
      - {key: ca.crt, path: ca.crt}
{{- end }}
{{- end }}

{{/* A gRPC health probe's handler: kubelet's own, or with mutual TLS (which kubelet's cannot
speak) the health_probe module in the container. Usage: include "kvmesh.grpcProbe" (list . port) */}}
{{- define "kvmesh.grpcProbe" -}}
{{- $root := index . 0 -}}
{{- $port := int (index . 1) -}}
{{- if $root.Values.internalAuth.tls.enabled -}}
exec:
  command:
    - python
    - -m
    - services.common.rpc.health_probe
    - --port={{ $port }}
    {{- include "kvmesh.tlsArgs" $root | nindent 4 }}
{{- else -}}
grpc:
  port: {{ $port }}
{{- end -}}
{{- end }}

{{/* A component's NetworkPolicy: ingress to its `port` (named; or a list of names) from the pods of component `from`
(anyone when empty), and to its metrics port (if any) from Prometheus.
Usage: include "kvmesh.networkPolicy" (list . "engine" "grpc" "processor" true) */}}
{{- define "kvmesh.networkPolicy" -}}
{{- $root := index . 0 }}
{{- $name := index . 1 }}
{{- $from := index . 3 }}
{{- if $root.Values.networkPolicy.enabled }}
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: {{ include "kvmesh.poolName" (list $root $name) }}
  labels:
    {{- include "kvmesh.labels" (list $root $name) | nindent 4 }}
spec:
  podSelector:
    matchLabels:
      {{- include "kvmesh.selectorLabels" (list $root $name) | nindent 6 }}
  policyTypes: [Ingress]
  ingress:
    - ports:
        {{- range $port := ternary (index . 2) (list (index . 2)) (kindIs "slice" (index . 2)) }}
        - port: {{ $port }}
        {{- end }}
      {{- if $from }}
      from:
        - podSelector:
            matchLabels:
              {{- include "kvmesh.selectorLabels" (list $root $from) | nindent 14 }}
      {{- end }}
    {{- if index . 4 }}
    - ports:
        - port: metrics
      from:
        {{- toYaml (list $root.Values.networkPolicy.prometheus) | nindent 8 }}
    {{- end }}
{{- end }}
{{- end }}

{{/* ---- Writable paths: the root filesystem is read-only, so what the services write goes to one emptyDir. */}}

{{/* Where each part of the scratch volume is mounted: /tmp (tempfile, the C compiler), HOME (Triton's
~/.triton, Hugging Face's ~/.cache/huggingface, CUDA's ~/.nv) and the image's KVMESH_CACHE_DIR (native
kernels and converted models, for the services whose KVMESH_CACHE_DIR is not on the model volume). */}}
{{- define "kvmesh.scratchPaths" -}}
tmp: /tmp
home: /home/kvmesh
cache: /var/cache/kvmesh
{{- end }}

{{- define "kvmesh.scratchVolume" -}}
- name: scratch
  emptyDir:
    sizeLimit: {{ .Values.scratch.sizeLimit }}
{{- end }}

{{- define "kvmesh.scratchVolumeMounts" -}}
{{- range $subPath, $path := include "kvmesh.scratchPaths" . | fromYaml }}
- name: scratch
  mountPath: {{ $path }}
  subPath: {{ $subPath }}
{{- end }}
{{- end }}

{{/* HOME from the image's passwd would be right too; set here so that a different runAsUser keeps it. */}}
{{- define "kvmesh.scratchEnv" -}}
- name: HOME
  value: {{ get (include "kvmesh.scratchPaths" . | fromYaml) "home" | quote }}
{{- end }}

{{/* ---- The prefix index's credentials: a password file, and TLS files for an external rediss:// Redis. */}}

{{/* The ACL user kvmesh logs in as: the chart's Redis always has one with a password; an external one as configured. */}}
{{- define "kvmesh.redisUsername" -}}
{{- if .Values.redis.auth.existingSecret }}{{ .Values.redis.auth.username }}{{ end }}
{{- end }}

{{/* Usage: include "kvmesh.prefixIndexAccessEnv" (list . "KVMESH_ENGINE") */}}
{{- define "kvmesh.prefixIndexAccessEnv" -}}
{{- $root := index . 0 }}
{{- $prefix := index . 1 }}
{{- $redis := $root.Values.redis }}
{{- if include "kvmesh.redisUrl" $root }}
{{- with include "kvmesh.redisUsername" $root }}
- name: {{ $prefix }}_PREFIX_INDEX_USERNAME
  value: {{ . | quote }}
{{- end }}
{{- if $redis.auth.existingSecret }}
- name: {{ $prefix }}_PREFIX_INDEX_PASSWORD_FILE
  value: /var/run/kvmesh/redis-auth/password
{{- end }}
{{- if and (not $redis.enabled) $redis.tls.existingSecret }}
- name: {{ $prefix }}_PREFIX_INDEX_CA_FILE
  value: /var/run/kvmesh/redis-tls/ca.crt
{{- if $redis.tls.clientCertificate }}
- name: {{ $prefix }}_PREFIX_INDEX_CERT_FILE
  value: /var/run/kvmesh/redis-tls/tls.crt
- name: {{ $prefix }}_PREFIX_INDEX_KEY_FILE
  value: /var/run/kvmesh/redis-tls/tls.key
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvmesh.prefixIndexVolumeMounts" -}}
{{- $redis := .Values.redis }}
{{- if include "kvmesh.redisUrl" . }}
{{- if $redis.auth.existingSecret }}
- name: redis-auth
  mountPath: /var/run/kvmesh/redis-auth
  readOnly: true
{{- end }}
{{- if and (not $redis.enabled) $redis.tls.existingSecret }}
- name: redis-tls
  mountPath: /var/run/kvmesh/redis-tls
  readOnly: true
{{- end }}
{{- end }}
{{- end }}

{{- define "kvmesh.prefixIndexVolumes" -}}
{{- $redis := .Values.redis }}
{{- if include "kvmesh.redisUrl" . }}
{{- with $redis.auth.existingSecret }}
- name: redis-auth
  secret:
    secretName: {{ . }}
    defaultMode: 0440
    items:
      - key: {{ $redis.auth.passwordKey }}
        path: password
{{- end }}
{{- if and (not $redis.enabled) $redis.tls.existingSecret }}
- name: redis-tls
  secret:
    secretName: {{ $redis.tls.existingSecret }}
    defaultMode: 0440
    items:
      - {key: ca.crt, path: ca.crt}
      {{- if $redis.tls.clientCertificate }}
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
      {{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* Every command kvmesh sends to Redis (services/prefix_index/redis_index.py REDIS_ACL_COMMANDS; a
test keeps the two the same): all the chart's Redis lets kvmesh's ACL user run. */}}
{{- define "kvmesh.redisAclCommands" -}}
ping evalsha script|load smembers hgetall xread xrevrange get set del exists sadd srem scard hset hget pexpire pttl xadd
{{- end }}

{{/* ---- Egress: what each component may open connections to. */}}

{{/* An egress rule to the pods of a component on named ports.
Usage: include "kvmesh.egressToComponent" (list . "engine" (list "grpc")) */}}
{{- define "kvmesh.egressToComponent" -}}
{{- $root := index . 0 -}}
- to:
    - podSelector:
        matchLabels:
          {{- include "kvmesh.selectorLabels" (list $root (index . 1)) | nindent 10 }}
  ports:
    {{- range index . 2 }}
    - port: {{ . }}
    {{- end }}
{{- end }}

{{/* The prefix index: the chart's Redis pods, or an external Redis's port (at networkPolicy.egress.externalRedis
when given, else anywhere). Empty without Redis. */}}
{{- define "kvmesh.egressToRedis" -}}
{{- $redis := .Values.redis }}
{{- if $redis.enabled }}
{{- include "kvmesh.egressToComponent" (list . "redis" (list "redis")) }}
{{- else if $redis.url }}
{{- $host := (urlParse $redis.url).host }}
{{- $port := ternary (regexReplaceAll ".*:" $host "") "6379" (regexMatch ":[0-9]+$" $host) -}}
- ports:
    - port: {{ int $port }}
      protocol: TCP
  {{- with .Values.networkPolicy.egress.externalRedis }}
  to:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
{{- end }}

{{/* Discovery (EndpointSlices): the Kubernetes API server. */}}
{{- define "kvmesh.egressToKubernetesApi" -}}
{{- $api := .Values.networkPolicy.egress.kubernetesApi -}}
- to:
    {{- toYaml $api.to | nindent 4 }}
  ports:
    {{- range $api.ports }}
    - port: {{ . }}
      protocol: TCP
    {{- end }}
{{- end }}

{{/* A component's egress NetworkPolicy: `rules` (rendered egress rules), DNS, and the component's
networkPolicy.egress.extra. Usage: include "kvmesh.egressPolicy" (list . "engine" $rules) */}}
{{- define "kvmesh.egressPolicy" -}}
{{- $root := index . 0 }}
{{- $name := index . 1 }}
{{- $policy := $root.Values.networkPolicy }}
{{- if and $policy.enabled $policy.egress.enabled }}
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: {{ include "kvmesh.poolName" (list $root $name "egress") }}
  labels:
    {{- include "kvmesh.labels" (list $root $name) | nindent 4 }}
spec:
  podSelector:
    matchLabels:
      {{- include "kvmesh.selectorLabels" (list $root $name) | nindent 6 }}
  policyTypes: [Egress]
  egress:
    {{- with index . 2 }}
    {{- . | nindent 4 }}
    {{- end }}
    - to:
        {{- toYaml $policy.egress.dns.to | nindent 8 }}
      ports:
        - {port: 53, protocol: UDP}
        - {port: 53, protocol: TCP}
    {{- with get $policy.egress.extra $name }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}
{{- end }}
