{{/* Names: every object is <fullname>-<component>; fullname is kept short enough for the suffixes. */}}
{{- define "kvcascade.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{- define "kvcascade.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvcascade.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "kvcascade.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvcascade
{{- end }}

{{/* Selector labels of one component: (dict "ctx" $ "component" "router") */}}
{{- define "kvcascade.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvcascade.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kvcascade.componentLabels" -}}
{{ include "kvcascade.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kvcascade.image" -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) }}
{{- end }}

{{- define "kvcascade.routerName" -}}{{ include "kvcascade.fullname" . }}-router{{- end }}
{{- define "kvcascade.workerName" -}}{{ include "kvcascade.fullname" . }}-worker{{- end }}
{{- define "kvcascade.redisName" -}}{{ include "kvcascade.fullname" . }}-redis{{- end }}
{{- define "kvcascade.rayClusterName" -}}{{ include "kvcascade.fullname" . }}-ray{{- end }}

{{/* The Secret holding the bundled Redis's password. */}}
{{- define "kvcascade.redisSecretName" -}}
{{- default (include "kvcascade.redisName" .) .Values.redis.bundled.auth.existingSecret }}
{{- end }}

{{- define "kvcascade.apiKeysSecretName" -}}
{{- default (printf "%s-api-keys" (include "kvcascade.fullname" .)) .Values.router.apiKeys.existingSecret }}
{{- end }}

{{/*
Checks across values that the schema cannot word clearly; every workload template includes it.
*/}}
{{- define "kvcascade.validate" -}}
{{- $r := .Values.redis }}
{{- if $r.bundled.enabled }}
{{- if or $r.external.url $r.external.urlKey }}
{{- fail "redis: set redis.bundled.enabled=false to use redis.external (both are set)" }}
{{- end }}
{{- else if not (or $r.external.url $r.external.urlKey) }}
{{- fail "redis: with redis.bundled.enabled=false, set redis.external.url (or redis.external.existingSecret with urlKey)" }}
{{- else if and $r.external.url $r.external.urlKey }}
{{- fail "redis.external: set url or urlKey, not both" }}
{{- else if and (or $r.external.urlKey $r.external.passwordKey) (not $r.external.existingSecret) }}
{{- fail "redis.external: urlKey and passwordKey name keys of redis.external.existingSecret, which is empty" }}
{{- end }}
{{- if and (eq .Values.workers.device "cpu") (gt (int .Values.workers.tp) 1) }}
{{- fail "workers.tp > 1 needs workers.device=cuda (tensor parallelism runs across GPUs)" }}
{{- end }}
{{- if and .Values.router.apiKeys.enabled (not .Values.router.apiKeys.existingSecret) (not .Values.router.apiKeys.keys) }}
{{- fail "router.apiKeys.enabled: name a Secret in router.apiKeys.existingSecret or list router.apiKeys.keys" }}
{{- end }}
{{- if and .Values.workers.kuberay.enabled (eq .Values.workers.device "cpu") }}
{{- fail "workers.kuberay.enabled runs GPU worker groups: it needs workers.device=cuda" }}
{{- end }}
{{- $router := .Values.router }}
{{- if and $router.tls.enabled (not $router.tls.secretName) }}
{{- fail "router.tls.enabled: name the kubernetes.io/tls Secret (tls.crt, tls.key) in router.tls.secretName" }}
{{- end }}
{{- if and $router.limits.rateBurst (not $router.limits.rateLimit) }}
{{- fail "router.limits.rateBurst is a burst above router.limits.rateLimit: set rateLimit too" }}
{{- end }}
{{- if and $router.metrics.protect (not $router.apiKeys.enabled) }}
{{- fail "router.metrics.protect checks /metrics against the API keys: it needs router.apiKeys.enabled" }}
{{- end }}
{{- if and $router.metrics.protect .Values.serviceMonitor.enabled (not $router.metrics.scrapeKeySecret.name) }}
{{- fail "router.metrics.protect with serviceMonitor.enabled: name the Secret holding Prometheus's API key in router.metrics.scrapeKeySecret.name" }}
{{- end }}
{{- if and .Values.serviceMonitor.tls.insecureSkipVerify .Values.serviceMonitor.tls.caSecret.name }}
{{- fail "serviceMonitor.tls: set caSecret (verify the router's certificate) or insecureSkipVerify, not both" }}
{{- end }}
{{- end }}

{{/* Where the router's TLS Secret is mounted: --tls-cert and --tls-key point into it. */}}
{{- define "kvcascade.routerTlsPath" -}}/etc/kvcascade/tls{{- end }}

{{/* The router Service's in-cluster DNS name: what its certificate should name. */}}
{{- define "kvcascade.routerHost" -}}
{{- printf "%s.%s.svc" (include "kvcascade.routerName" .) .Release.Namespace }}
{{- end }}

{{/*
The Redis URL as the containers see it: the password is substituted by Kubernetes from the
REDIS_PASSWORD env var ($(VAR) in args), or the whole URL comes from REDIS_URL; never a literal.
*/}}
{{- define "kvcascade.redisUrl" -}}
{{- $r := .Values.redis }}
{{- if $r.bundled.enabled }}
{{- printf "redis://:$(REDIS_PASSWORD)@%s:%d/0" (include "kvcascade.redisName" .) (int $r.bundled.port) }}
{{- else if $r.external.urlKey }}
{{- print "$(REDIS_URL)" }}
{{- else if $r.external.passwordKey }}
{{- regexReplaceAll "^(rediss?)://" $r.external.url "${1}://:$$(REDIS_PASSWORD)@" }}
{{- else }}
{{- $r.external.url }}
{{- end }}
{{- end }}

{{- define "kvcascade.redisEnv" -}}
{{- $r := .Values.redis }}
{{- if $r.bundled.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "kvcascade.redisSecretName" . }}
      key: {{ $r.bundled.auth.secretKey }}
{{- else if $r.external.urlKey }}
- name: REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ $r.external.existingSecret }}
      key: {{ $r.external.urlKey }}
{{- else if $r.external.passwordKey }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $r.external.existingSecret }}
      key: {{ $r.external.passwordKey }}
{{- end }}
{{- end }}

{{/* The flags router and workers share: Redis and its key prefix. */}}
{{- define "kvcascade.stateArgs" -}}
- --redis-url
- {{ include "kvcascade.redisUrl" . | quote }}
{{- with .Values.redis.keyPrefix }}
- --key-prefix
- {{ . | quote }}
{{- end }}
{{- end }}

{{/* Writable places under a read-only root: caches (tokenizers, Triton kernels) and /tmp. */}}
{{- define "kvcascade.cacheEnv" -}}
- name: HOME
  value: /tmp
- name: KVCASCADE_CACHE
  value: /cache/kvcascade
- name: HF_HOME
  value: /cache/huggingface
- name: HF_HUB_OFFLINE
  value: "1"
- name: TRITON_CACHE_DIR
  value: /cache/triton
- name: PYTHONUNBUFFERED
  value: "1"
{{- end }}

{{- define "kvcascade.cacheMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /cache
{{- end }}

{{- define "kvcascade.cacheVolumes" -}}
- name: tmp
  emptyDir: {}
- name: cache
  emptyDir: {}
{{- end }}

{{- define "kvcascade.modelMount" -}}
{{- if .Values.workers.modelVolume }}
- name: model
  mountPath: {{ .Values.workers.modelMountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "kvcascade.modelVolume" -}}
{{- with .Values.workers.modelVolume }}
- name: model
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* `kvcascade worker` flags: the same with or without KubeRay. */}}
{{- define "kvcascade.workerArgs" -}}
{{- $w := .Values.workers }}
- --host
- 0.0.0.0
- --port
- {{ $w.port | quote }}
- --worker-id
- $(POD_NAME)
- --advertise-address
- {{ printf "$(POD_IP):%d" (int $w.port) | quote }}
{{- with include "kvcascade.stateArgs" . | trim }}
{{ . }}
{{- end }}
- --model
- {{ $w.model | quote }}
- --device
- {{ $w.device }}
{{- if gt (int $w.tp) 1 }}
- --tp
- {{ $w.tp | quote }}
{{- end }}
{{- range $flag, $value := $w.engine }}
- --{{ $flag }}
- {{ include "kvcascade.flagValue" $value | quote }}
{{- end }}
{{- with $w.heartbeatTtl }}
- --heartbeat-ttl
- {{ include "kvcascade.flagValue" . | quote }}
{{- end }}
- --grace-period
- {{ sub (int $w.terminationGracePeriodSeconds) 10 | max 1 | quote }}
{{- range $w.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{- define "kvcascade.workerEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- with include "kvcascade.redisEnv" . | trim }}
{{ . }}
{{- end }}
{{- with include "kvcascade.cacheEnv" . | trim }}
{{ . }}
{{- end }}
{{- with .Values.workers.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "kvcascade.workerResources" -}}
{{- $res := deepCopy .Values.workers.resources }}
{{- if eq .Values.workers.device "cuda" }}
{{- $limits := default dict $res.limits }}
{{- $_ := set $limits "nvidia.com/gpu" (int .Values.workers.tp) }}
{{- $_ := set $res "limits" $limits }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{- define "kvcascade.workerProbes" -}}
{{- $w := .Values.workers }}
startupProbe:
  grpc:
    port: {{ $w.port }}
  periodSeconds: {{ $w.startupProbe.periodSeconds }}
  failureThreshold: {{ $w.startupProbe.failureThreshold }}
readinessProbe:
  grpc:
    port: {{ $w.port }}
  periodSeconds: 5
  failureThreshold: 2
livenessProbe:
  grpc:
    port: {{ $w.port }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
{{- end }}

{{- define "kvcascade.workerVolumes" -}}
- name: tmp
  emptyDir: {}
- name: cache
{{- with .Values.workers.cacheVolume }}
  {{- toYaml . | nindent 2 }}
{{- else }}
  emptyDir: {}
{{- end }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.workers.shmSize }}
{{- with include "kvcascade.modelVolume" . | trim }}
{{ . }}
{{- end }}
{{- end }}

{{- define "kvcascade.workerMounts" -}}
{{- with include "kvcascade.cacheMounts" . | trim }}
{{ . }}
{{- end }}
- name: dshm
  mountPath: /dev/shm
{{- with include "kvcascade.modelMount" . | trim }}
{{ . }}
{{- end }}
{{- end }}

{{/* A value as a flag: whole numbers without an exponent (JSON numbers arrive as float64). */}}
{{- define "kvcascade.flagValue" -}}
{{- if and (kindIs "float64" .) (eq . (floor .)) }}{{ int64 . }}{{ else }}{{ . }}{{ end }}
{{- end }}
