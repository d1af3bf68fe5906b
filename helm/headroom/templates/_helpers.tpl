{{- define "headroom.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-qualified name; the release name alone when it already contains the chart's. At
     most 47 characters: KubeRay refuses a longer RayService name (its RayClusters' names add
     a suffix within 53), and the clients' Service adds "-serve" within 63. */}}
{{- define "headroom.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 47 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 47 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "headroom.selectorLabels" -}}
app.kubernetes.io/name: {{ include "headroom.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "headroom.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "headroom.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "headroom.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* The replica /metrics port: every application's args.ports.metrics must agree, since
     the pod exposes and the PodMonitor scrapes one port. */}}
{{- define "headroom.metricsPort" -}}
{{- $ports := list }}
{{- range .Values.serve.applications }}
{{- $ports = append $ports (((.args | default dict).ports | default dict).metrics | default 9100 | int) }}
{{- end }}
{{- $ports = uniq $ports }}
{{- if ne (len $ports) 1 }}
{{- fail (printf "serve.applications[].args.ports.metrics: all applications must use one port, got %v" $ports) }}
{{- end }}
{{- first $ports }}
{{- end }}

{{/* The router /metrics port of each application (a JSON list, in the applications' order),
     on the head pod, where every application's ingress runs: its args.ports.router_metrics,
     else 9200 + its index. Each ingress binds the first free port from its own, so distinct
     ports keep each one on its own port, which the head declares and the router PodMonitor
     scrapes with that application's name (serveConfig writes them into the args). */}}
{{- define "headroom.routerMetricsPorts" -}}
{{- $ports := list }}
{{- range $index, $app := .Values.serve.applications }}
{{- $set := (($app.args | default dict).ports | default dict).router_metrics }}
{{- $port := $set | default (add 9200 $index) | int }}
{{- if has $port $ports }}
{{- fail (printf "serve.applications[%d].args.ports.router_metrics: %d%s is an earlier application's too; each application's ingress serves its router metrics on a port of its own" $index $port (ternary "" " (9200 + its index: it sets none)" (not (empty $set)))) }}
{{- end }}
{{- $ports = append $ports $port }}
{{- end }}
{{- toJson $ports }}
{{- end }}

{{/* The replicas' internal gRPC port (LoadReporter, cluster token; `args.ports.replica_grpc`):
     every application must agree, since the worker pod declares and the NetworkPolicy names one.
     0 (any free port) is a setting, not unset (`default` would take 9300 for it): nothing is
     declared then, and the NetworkPolicy's rule for the release's own pods admits every port. */}}
{{- define "headroom.replicaGrpcPort" -}}
{{- $ports := list }}
{{- range .Values.serve.applications }}
{{- $appPorts := (.args | default dict).ports | default dict }}
{{- $ports = append $ports (ternary $appPorts.replica_grpc 9300 (hasKey $appPorts "replica_grpc") | int) }}
{{- end }}
{{- $ports = uniq $ports }}
{{- if ne (len $ports) 1 }}
{{- fail (printf "serve.applications[].args.ports.replica_grpc: all applications must use one port, got %v" $ports) }}
{{- end }}
{{- first $ports }}
{{- end }}

{{/* The Secret holding the API key: the operator's (apiKey.existingSecret) or the chart's
     (from apiKey.value); empty when no key is configured. */}}
{{- define "headroom.apiKeySecret" -}}
{{- if and .Values.apiKey.existingSecret .Values.apiKey.value }}
{{- fail "apiKey: set existingSecret (recommended) or value, not both" }}
{{- end }}
{{- if .Values.apiKey.existingSecret }}
{{- .Values.apiKey.existingSecret }}
{{- else if .Values.apiKey.value }}
{{- printf "%s-api-key" (include "headroom.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* The pod templates' annotations: a checksum of the Secret's name and key and apiKey.revision
     (apiKey.existingSecret, or apiKey.value with a revision set), else of apiKey.value itself.
     The containers read HEADROOM_API_KEY from the Secret once, as they start: a rotated key
     changed nothing in the pod templates, and the old key stayed accepted until the pods happened
     to restart. A changed annotation is a changed RayService cluster spec, which KubeRay replaces
     (a new Ray cluster beside the old one until it serves). Helm keeps no state a secret salt could
     live in, so the value's checksum is an unsalted sha256 that anyone who reads the pods sees:
     values.yaml and the README say so (apiKey.value is for test clusters). */}}
{{- define "headroom.podAnnotations" -}}
{{- if or .Values.apiKey.existingSecret (and .Values.apiKey.value (ne (toString .Values.apiKey.revision) "")) }}
checksum/api-key: {{ printf "%s/%s/%v" (include "headroom.apiKeySecret" .) .Values.apiKey.secretKey .Values.apiKey.revision | sha256sum | quote }}
{{- else if .Values.apiKey.value }}
checksum/api-key: {{ .Values.apiKey.value | sha256sum | quote }}
{{- end }}
{{- end }}

{{/* What Serve's gRPC proxy takes per message before any handler runs (Serve's own default is
     2 GiB, buffered whole, the API key's check included): replica.server.request_limits.RequestLimits.message_cap
     of the largest application's limits, 4x max_request_bytes or 16x max_prompt_chars, at least
     32 MiB (the defaults are replica.server.request_limits'; tests/cluster/test_helm.py holds the
     chart to them). */}}
{{- define "headroom.grpcMaxMessageSize" -}}
{{- $cap := 33554432 }}
{{- range .Values.serve.applications }}
{{- $limits := (.args | default dict).limits | default dict }}
{{- $cap = max $cap (mul 4 ($limits.max_request_bytes | default 4194304 | int64)) (mul 16 ($limits.max_prompt_chars | default 1048576 | int64)) }}
{{- end }}
{{- $cap }}
{{- end }}

{{/* The largest application's limits.max_request_bytes: the size bound Serve's gRPC proxy,
     shared by every application, checks (INVALID_ARGUMENT beyond it), as `headroom serve` sets it
     (cluster.serve_command.set_ray_environment). */}}
{{- define "headroom.proxyMaxRequestBytes" -}}
{{- $bound := 0 }}
{{- range .Values.serve.applications }}
{{- $limits := (.args | default dict).limits | default dict }}
{{- $bound = max $bound ($limits.max_request_bytes | default 4194304 | int64) }}
{{- end }}
{{- $bound }}
{{- end }}

{{/* The containers' env: Serve's gRPC message cap and its proxy's size bound, and
     HEADROOM_API_KEY from the Secret when one is configured (HEADROOM_API_KEY_REQUIRED with it). */}}
{{- define "headroom.env" -}}
env:
  - name: RAY_SERVE_GRPC_MAX_MESSAGE_SIZE
    value: {{ include "headroom.grpcMaxMessageSize" . | quote }}
  - name: HEADROOM_PROXY_MAX_REQUEST_BYTES
    value: {{ include "headroom.proxyMaxRequestBytes" . | quote }}
{{- with include "headroom.apiKeySecret" . }}
  - name: HEADROOM_API_KEY
    valueFrom:
      secretKeyRef:
        name: {{ . }}
        key: {{ $.Values.apiKey.secretKey }}
  # A Secret whose value is blank fails the start rather than opening the doors.
  - name: HEADROOM_API_KEY_REQUIRED
    value: "1"
{{- end }}
{{- end }}

{{/* Serve's config as the RayService runs it: the `serve` values, each application's router
     metrics port written in, with the wait for it (ports.router_metrics_wait_s, unless set: the
     router PodMonitor scrapes that port alone, and an in-place update starts the new ingress while
     the old one drains on it, up to cluster/ingress.py's INGRESS_DRAIN_S + INGRESS_DEL_S, 25 s,
     which tests/cluster/test_helm.py holds this to), and HTTPS on the HTTP proxy from the mounted
     tls.existingSecret when one is set. */}}
{{- define "headroom.serveConfig" -}}
{{- $serve := deepCopy .Values.serve }}
{{- $routerPorts := include "headroom.routerMetricsPorts" . | fromJsonArray }}
{{- range $index, $app := $serve.applications }}
{{- $args := $app.args | default dict }}
{{- $ports := $args.ports | default dict }}
{{- $_ := set $ports "router_metrics" (index $routerPorts $index) }}
{{- if not (hasKey $ports "router_metrics_wait_s") }}
{{- $_ := set $ports "router_metrics_wait_s" 25 }}
{{- end }}
{{- $_ := set $args "ports" $ports }}
{{- $_ := set $app "args" $args }}
{{- end }}
{{- if ($serve.http_options | default dict).ssl_ca_certs }}
{{- fail "serve.http_options.ssl_ca_certs: refused: Ray Serve 2.60's HTTP proxy never requests a client certificate with it, so it would let every client in; require client certificates at a TLS-terminating proxy in front, or use API keys (apiKey)" }}
{{- end }}
{{- if .Values.tls.existingSecret }}
{{- $http := $serve.http_options | default dict }}
{{- if or $http.ssl_certfile $http.ssl_keyfile }}
{{- fail "tls: set tls.existingSecret or serve.http_options.ssl_certfile/ssl_keyfile, not both" }}
{{- end }}
{{- $_ := set $http "ssl_certfile" (printf "%s/tls.crt" (trimSuffix "/" .Values.tls.mountPath)) }}
{{- $_ := set $http "ssl_keyfile" (printf "%s/tls.key" (trimSuffix "/" .Values.tls.mountPath)) }}
{{- $_ := set $serve "http_options" $http }}
{{- end }}
{{- toYaml $serve }}
{{- end }}

{{/* The pod's volume holding the HTTPS certificate and key (tls.existingSecret). */}}
{{- define "headroom.tlsVolumes" -}}
{{- if .Values.tls.existingSecret -}}
volumes:
  - name: serve-tls
    secret:
      secretName: {{ .Values.tls.existingSecret }}
{{- end }}
{{- end }}

{{/* Where the Ray container finds them: serveConfigV2's ssl_certfile and ssl_keyfile. */}}
{{- define "headroom.tlsVolumeMounts" -}}
{{- if .Values.tls.existingSecret -}}
volumeMounts:
  - name: serve-tls
    mountPath: {{ .Values.tls.mountPath }}
    readOnly: true
{{- end }}
{{- end }}
