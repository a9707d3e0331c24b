{{/* Names ------------------------------------------------------------------------------ */}}

{{- define "kvroute.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvroute.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Component names stay under 63 characters with their suffix. */}}
{{- define "kvroute.routerName" -}}{{ include "kvroute.fullname" . | trunc 56 | trimSuffix "-" }}-router{{- end -}}
{{- define "kvroute.workersName" -}}{{ include "kvroute.fullname" . | trunc 55 | trimSuffix "-" }}-worker{{- end -}}
{{- define "kvroute.redisName" -}}{{ include "kvroute.fullname" . | trunc 57 | trimSuffix "-" }}-redis{{- end -}}

{{/* Labels ----------------------------------------------------------------------------- */}}

{{- define "kvroute.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "kvroute.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvroute
{{- end -}}

{{/* Selector labels of one component: (dict "ctx" $ "component" "router") */}}
{{- define "kvroute.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvroute.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kvroute.componentLabels" -}}
{{ include "kvroute.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* The label selector the router's Kubernetes discovery watches worker pods with. */}}
{{- define "kvroute.workerSelector" -}}
app.kubernetes.io/name={{ include "kvroute.name" . }},app.kubernetes.io/instance={{ .Release.Name }},app.kubernetes.io/component=worker
{{- end -}}

{{- define "kvroute.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "kvroute.routerServiceAccount" -}}
{{- if .Values.router.serviceAccount.create -}}
{{ default (include "kvroute.routerName" .) .Values.router.serviceAccount.name }}
{{- else -}}
{{ default "default" .Values.router.serviceAccount.name }}
{{- end -}}
{{- end -}}

{{- define "kvroute.workerServiceAccount" -}}
{{- if .Values.workers.serviceAccount.create -}}
{{ default (include "kvroute.workersName" .) .Values.workers.serviceAccount.name }}
{{- else -}}
{{ default "default" .Values.workers.serviceAccount.name }}
{{- end -}}
{{- end -}}

{{- define "kvroute.servedModelName" -}}
{{ default .Values.model.name .Values.workers.vllm.servedModelName }}
{{- end -}}

{{/* Redis ------------------------------------------------------------------------------ */}}

{{- define "kvroute.redisSecretName" -}}
{{- if eq .Values.redis.mode "builtin" -}}
{{ default (include "kvroute.redisName" .) .Values.redis.builtin.existingSecret }}
{{- else -}}
{{ .Values.redis.external.existingSecret }}
{{- end -}}
{{- end -}}

{{- define "kvroute.redisSecretKey" -}}
{{- if eq .Values.redis.mode "builtin" -}}
{{ .Values.redis.builtin.existingSecretKey }}
{{- else -}}
{{ .Values.redis.external.existingSecretKey }}
{{- end -}}
{{- end -}}

{{- define "kvroute.redisHasPassword" -}}
{{- if or (eq .Values.redis.mode "builtin") .Values.redis.external.existingSecret -}}true{{- end -}}
{{- end -}}

{{- define "kvroute.redisTlsDir" -}}/etc/kvroute/redis-tls{{- end -}}

{{/* The built-in Redis serves TLS whenever the parts do (tls.enabled). */}}
{{- define "kvroute.redisBuiltinTls" -}}
{{- if and (eq .Values.redis.mode "builtin") .Values.tls.enabled -}}true{{- end -}}
{{- end -}}

{{/* The Secret of the built-in Redis's server certificate: the one named, else
cert-manager's (templates/tls/certificates.yaml). */}}
{{- define "kvroute.redisTlsSecret" -}}
{{- if .Values.redis.builtin.tls.secret -}}
{{ .Values.redis.builtin.tls.secret }}
{{- else if .Values.tls.certManager.enabled -}}
{{ include "kvroute.redisName" . }}-tls
{{- end -}}
{{- end -}}

{{/* The built-in Redis's ACL users (templates/redis/redis.yaml): the admin (default)
user, for operators and probes, and one least-privilege user per role, each with its
password's key in the Redis Secret. */}}
{{- define "kvroute.redisRoleKey" -}}{{ . }}-password{{- end -}}

{{/* The Redis URL: no credentials in it (they come from KVROUTE_REDIS_USERNAME and
KVROUTE_REDIS_PASSWORD, commonEnv). */}}
{{- define "kvroute.redisUrl" -}}
{{- $v := .Values.redis -}}
{{- if eq $v.mode "builtin" -}}
{{ ternary "rediss" "redis" (eq (include "kvroute.redisBuiltinTls" .) "true") }}://{{ include "kvroute.redisName" . }}:6379/0
{{- else -}}
{{- $e := $v.external -}}
{{- $q := list -}}
{{- if $e.tls.enabled -}}
{{- if $e.tls.caSecret }}{{ $q = append $q (printf "ssl_ca_certs=%s/ca/%s" (include "kvroute.redisTlsDir" .) $e.tls.caSecretKey) }}{{ end -}}
{{- if $e.tls.clientSecret }}{{ $q = append $q (printf "ssl_certfile=%s/client/tls.crt" (include "kvroute.redisTlsDir" .)) }}{{ $q = append $q (printf "ssl_keyfile=%s/client/tls.key" (include "kvroute.redisTlsDir" .)) }}{{ end -}}
{{- if $e.tls.insecureSkipVerify }}{{ $q = append $q "ssl_cert_reqs=none" }}{{ $q = append $q "ssl_check_hostname=false" }}{{ end -}}
{{- end -}}
{{ ternary "rediss" "redis" $e.tls.enabled }}{{ if $e.cluster }}+cluster{{ end }}://{{ required "redis.mode=external needs redis.external.host" $e.host }}:{{ $e.port }}{{ if not $e.cluster }}/{{ $e.db }}{{ end }}{{ if $q }}?{{ join "&" $q }}{{ end }}
{{- end -}}
{{- end -}}

{{/* Env entries every kvroute container gets: Redis, model, block size, logging. Called
with (dict "root" $ "role" "router"|"agent"): with the built-in Redis each role logs in as
its own ACL user. The password comes from the Secret as an environment variable, never an
argument or the URL (which other processes and logs could show). */}}
{{- define "kvroute.commonEnv" -}}
{{- $root := .root -}}
{{- $v := $root.Values.redis -}}
{{- if eq $v.mode "builtin" }}
- name: KVROUTE_REDIS_USERNAME
  value: {{ .role | quote }}
- name: KVROUTE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "kvroute.redisSecretName" $root }}
      key: {{ include "kvroute.redisRoleKey" .role }}
{{- if include "kvroute.redisBuiltinTls" $root }}
# The Redis certificate comes from the same CA; the part's own is its client certificate.
- name: KVROUTE_REDIS_CA_FILE
  value: /etc/kvroute/tls/ca.crt
- name: KVROUTE_REDIS_CERT_FILE
  value: /etc/kvroute/tls/tls.crt
- name: KVROUTE_REDIS_KEY_FILE
  value: /etc/kvroute/tls/tls.key
{{- end }}
{{- else if $v.external.existingSecret }}
{{- with $v.external.username }}
- name: KVROUTE_REDIS_USERNAME
  value: {{ . | quote }}
{{- end }}
- name: KVROUTE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "kvroute.redisSecretName" $root }}
      key: {{ include "kvroute.redisSecretKey" $root }}
{{- else if $v.external.username }}
- name: KVROUTE_REDIS_USERNAME
  value: {{ $v.external.username | quote }}
{{- end }}
- name: KVROUTE_REDIS
  value: {{ include "kvroute.redisUrl" $root | quote }}
- name: KVROUTE_MODEL
  value: {{ $root.Values.model.name | quote }}
- name: KVROUTE_BLOCK_SIZE
  value: {{ $root.Values.model.blockSize | quote }}
- name: KVROUTE_LOG_LEVEL
  value: {{ $root.Values.logging.level | quote }}
- name: KVROUTE_LOG_JSON
  value: {{ $root.Values.logging.json | quote }}
- name: KVROUTE_GRPC_REFLECTION
  value: {{ $root.Values.grpcReflection | quote }}
{{- end -}}

{{- define "kvroute.redisTlsVolumes" -}}
{{- $e := .Values.redis.external -}}
{{- if and (eq .Values.redis.mode "external") $e.tls.enabled -}}
{{- if $e.tls.caSecret }}
- name: redis-tls-ca
  secret:
    secretName: {{ $e.tls.caSecret }}
{{- end }}
{{- if $e.tls.clientSecret }}
- name: redis-tls-client
  secret:
    secretName: {{ $e.tls.clientSecret }}
{{- end }}
{{- end -}}
{{- end -}}

{{- define "kvroute.redisTlsMounts" -}}
{{- $e := .Values.redis.external -}}
{{- if and (eq .Values.redis.mode "external") $e.tls.enabled -}}
{{- if $e.tls.caSecret }}
- name: redis-tls-ca
  mountPath: {{ include "kvroute.redisTlsDir" . }}/ca
  readOnly: true
{{- end }}
{{- if $e.tls.clientSecret }}
- name: redis-tls-client
  mountPath: {{ include "kvroute.redisTlsDir" . }}/client
  readOnly: true
{{- end }}
{{- end -}}
{{- end -}}

{{/* kvroute's containers: the image's user (Dockerfile), nothing else allowed. */}}
{{- define "kvroute.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* Fail early on combinations that cannot work. */}}
{{- define "kvroute.validate" -}}
{{- if and .Values.redis.external.tls.caSecret (not .Values.redis.external.tls.enabled) -}}
{{- fail "redis.external.tls.caSecret is set but redis.external.tls.enabled is false" -}}
{{- end -}}
{{- if and (eq .Values.workers.mode "vllm") (ne .Values.workers.agent.engine "vllm") -}}
{{- fail "workers.mode=vllm runs the vllm engine: set workers.agent.engine=vllm or workers.mode=agentOnly" -}}
{{- end -}}
{{- if and .Values.epp.enabled .Values.epp.httpRoute.enabled (not .Values.epp.httpRoute.gateway.name) -}}
{{- fail "epp.httpRoute.enabled needs epp.httpRoute.gateway.name (the Gateway the route attaches to)" -}}
{{- end -}}
{{- if and .Values.router.autoscaling.enabled (gt (int .Values.router.autoscaling.minReplicas) (int .Values.router.autoscaling.maxReplicas)) -}}
{{- fail "router.autoscaling.minReplicas must not exceed maxReplicas" -}}
{{- end -}}
{{- end -}}

{{/* The InferencePool's name (and its HTTPRoute's): epp.poolName, else the full name. */}}
{{- define "kvroute.poolName" -}}
{{- default (include "kvroute.fullname" .) .Values.epp.poolName | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
TLS (tls.enabled, docs/security.md): a part's environment, its certificate Secret's volume
and mount (a whole directory, not subPath: the kubelet then swaps renewed files in, and
kvroute re-reads them), and the port its probes use (the plaintext health port: the
kubelet's gRPC probes cannot do TLS). Called with (dict "root" $ "role" "router"|"agent").
*/}}
{{- define "kvroute.tlsEnv" -}}
{{- $t := .root.Values.tls -}}
{{- if $t.enabled }}
- name: KVROUTE_TLS_CERT
  value: /etc/kvroute/tls/tls.crt
- name: KVROUTE_TLS_KEY
  value: /etc/kvroute/tls/tls.key
- name: KVROUTE_TLS_CA
  value: /etc/kvroute/tls/ca.crt
- name: KVROUTE_TLS_SERVER_NAME
  value: {{ $t.agentServerName | quote }}
{{- if or (eq .role "agent") $t.requireClientCerts }}
- name: KVROUTE_TLS_CLIENT_CA
  value: /etc/kvroute/tls/ca.crt
{{- end }}
{{- if eq .role "agent" }}
- name: KVROUTE_TLS_ALLOWED_SANS
  value: {{ printf "%s,%s" $t.routerSan $t.agentServerName | quote }}
{{- end }}
- name: KVROUTE_HEALTH_PORT
  value: {{ include "kvroute.healthPort" . | quote }}
{{- end }}
{{- end -}}

{{- define "kvroute.healthPort" -}}
{{- $t := .root.Values.tls -}}
{{- eq .role "agent" | ternary $t.agentHealthPort $t.routerHealthPort -}}
{{- end -}}

{{- define "kvroute.tlsVolume" -}}
{{- $t := .root.Values.tls -}}
{{- if $t.enabled }}
{{- $secret := include "kvroute.tlsSecret" . }}
{{- if not $secret }}
{{- fail (printf "tls.enabled needs tls.%sSecret (a Secret with tls.crt, tls.key and ca.crt)" .role) }}
{{- end }}
- name: kvroute-tls
  secret:
    secretName: {{ $secret }}
{{- end }}
{{- end -}}

{{- define "kvroute.tlsMount" -}}
{{- if .Values.tls.enabled }}
- name: kvroute-tls
  mountPath: /etc/kvroute/tls
  readOnly: true
{{- end }}
{{- end -}}

{{- /* The Secret of a role's certificate: the one named, else cert-manager's default. */}}
{{- define "kvroute.tlsSecret" -}}
{{- $t := .root.Values.tls -}}
{{- $named := eq .role "agent" | ternary $t.agentSecret $t.routerSecret -}}
{{- if $named -}}
{{- $named -}}
{{- else if $t.certManager.enabled -}}
{{- eq .role "agent" | ternary (include "kvroute.workersName" .root) (include "kvroute.routerName" .root) -}}-tls
{{- end -}}
{{- end -}}
