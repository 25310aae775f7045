{{/*
Names, labels and the per-tier building blocks shared by every template.
The three tiers (gateway, drafter, verifier) have values of the same shape, so each kind of
object (Deployment, Service, HPA, PDB, NetworkPolicy) is rendered by one helper called with
(dict "root" $ "tier" "<tier>") from a small file named by kind and tier.
*/}}

{{- define "specmesh.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "specmesh.fullname" -}}
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

{{/* Name of one component's objects: <fullname>-<component>, at most 63 characters. */}}
{{- define "specmesh.componentName" -}}
{{- printf "%s-%s" (include "specmesh.fullname" .root | trunc 52 | trimSuffix "-") .component }}
{{- end }}

{{- define "specmesh.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of one component: (dict "root" $ "component" "gateway"). */}}
{{- define "specmesh.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specmesh.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* The standard labels of one component's objects. */}}
{{- define "specmesh.labels" -}}
helm.sh/chart: {{ include "specmesh.chart" .root }}
{{ include "specmesh.selectorLabels" . }}
app.kubernetes.io/part-of: specmesh
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* image reference of a tier; the tag defaults to the chart's appVersion, never `latest`. */}}
{{- define "specmesh.image" -}}
{{- $tag := .image.tag | default .root.Chart.AppVersion | toString }}
{{- if eq $tag "latest" }}
{{- fail (printf "%s.image.tag: pin a version; `latest` is not allowed" .tier) }}
{{- end }}
{{- printf "%s:%s" .image.repository $tag }}
{{- end }}

{{/* Service account names. */}}
{{- define "specmesh.gatewayServiceAccountName" -}}
{{- if .Values.rbac.serviceAccountName }}{{ .Values.rbac.serviceAccountName }}{{ else }}{{ include "specmesh.componentName" (dict "root" . "component" "gateway") }}{{ end }}
{{- end }}

{{- define "specmesh.workloadServiceAccountName" -}}
{{- include "specmesh.fullname" . }}
{{- end }}

{{/* In-cluster DNS name of a tier's Service. */}}
{{- define "specmesh.serviceHost" -}}
{{- printf "%s.%s.svc.%s" (include "specmesh.componentName" (dict "root" .root "component" .component)) .root.Release.Namespace .root.Values.clusterDomain }}
{{- end }}

{{/* Redis: the bundled StatefulSet is used unless redis.external.url is set. */}}
{{- define "specmesh.redis.bundled" -}}
{{- if not .Values.redis.external.url }}true{{ end }}
{{- end }}

{{- define "specmesh.redis.secretName" -}}
{{- if .Values.redis.external.url }}
{{- .Values.redis.external.existingSecret }}
{{- else if .Values.redis.auth.existingSecret }}
{{- .Values.redis.auth.existingSecret }}
{{- else }}
{{- include "specmesh.componentName" (dict "root" . "component" "redis") }}
{{- end }}
{{- end }}

{{- define "specmesh.redis.secretKey" -}}
{{- if .Values.redis.external.url }}{{ .Values.redis.external.existingSecretPasswordKey }}{{ else }}{{ .Values.redis.auth.existingSecretPasswordKey }}{{ end }}
{{- end }}

{{/*
The environment every tier gets from the chart. Names are the SPECMESH_* variables that
`specmesh <tier>` reads (specmesh/cli.py); tests/test_helm_chart.py checks they agree.
*/}}
{{- define "specmesh.env" -}}
{{- $root := .root }}
{{- $v := index $root.Values .tier }}
{{- $c := $v.config }}
- name: SPECMESH_HOST
  value: "0.0.0.0"
- name: SPECMESH_PORT
  value: {{ $v.service.port | quote }}
- name: SPECMESH_LOG_LEVEL
  value: {{ $c.logLevel | quote }}
- name: SPECMESH_LOG_FORMAT
  value: "json"
- name: SPECMESH_METRICS_PORT
  value: {{ $root.Values.serviceMonitor.port | quote }}
{{- $secret := include "specmesh.redis.secretName" $root }}
{{- if $secret }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ include "specmesh.redis.secretKey" $root }}
{{- end }}
- name: SPECMESH_REDIS_URL
{{- if $root.Values.redis.external.url }}
  value: {{ $root.Values.redis.external.url | quote }}
{{- else }}
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s:%d/0" (include "specmesh.serviceHost" (dict "root" $root "component" "redis")) (int $root.Values.redis.service.port) | quote }}
{{- end }}
{{- if eq .tier "gateway" }}
- name: SPECMESH_VERIFIERS
  value: {{ printf "%s:%d" (include "specmesh.serviceHost" (dict "root" $root "component" "verifier")) (int $root.Values.verifier.service.port) | quote }}
- name: SPECMESH_DRAFTERS
  value: {{ printf "%s:%d" (include "specmesh.serviceHost" (dict "root" $root "component" "drafter")) (int $root.Values.drafter.service.port) | quote }}
- name: SPECMESH_DISCOVERY
  value: {{ $c.discovery | quote }}
- name: SPECMESH_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: SPECMESH_DRAFTER_SERVICE
  value: {{ include "specmesh.componentName" (dict "root" $root "component" "drafter") | quote }}
- name: SPECMESH_VERIFIER_SERVICE
  value: {{ include "specmesh.componentName" (dict "root" $root "component" "verifier") | quote }}
- name: SPECMESH_DRAFTER_PORT
  value: {{ $root.Values.drafter.service.port | quote }}
- name: SPECMESH_VERIFIER_PORT
  value: {{ $root.Values.verifier.service.port | quote }}
{{- with $c.model }}
- name: SPECMESH_MODEL
  value: {{ . | quote }}
{{- end }}
- name: SPECMESH_NUM_DRAFT_TOKENS
  value: {{ $c.numDraftTokens | quote }}
- name: SPECMESH_SPEC_FALLBACK
  value: {{ $c.specFallback | quote }}
- name: SPECMESH_PIPELINE
  value: {{ $c.pipeline | quote }}
- name: SPECMESH_LEAD_ROUND
  value: {{ $c.leadRound | quote }}
- name: SPECMESH_SPEC_FANOUT
  value: {{ $c.specFanout | quote }}
- name: SPECMESH_SPEC_MAX_REQUESTS
  value: {{ $c.specMaxRequests | quote }}
- name: SPECMESH_STEP_BATCHING
  value: {{ $c.stepBatching | quote }}
- name: SPECMESH_PLAIN_TOKENS
  value: {{ $c.plainTokens | quote }}
- name: SPECMESH_DECODE_AHEAD
  value: {{ $c.decodeAhead | quote }}
- name: SPECMESH_PREFIX_AFFINITY
  value: {{ $c.prefixAffinity | quote }}
- name: SPECMESH_MAX_SUPPORT
  value: {{ $c.maxSupport | quote }}
- name: SPECMESH_DEFAULT_MAX_NEW_TOKENS
  value: {{ $c.defaultMaxNewTokens | quote }}
- name: SPECMESH_MAX_NEW_TOKENS_CAP
  value: {{ $c.maxNewTokensCap | quote }}
- name: SPECMESH_MAX_INFLIGHT
  value: {{ $c.maxInflight | quote }}
- name: SPECMESH_SESSION_TTL_S
  value: {{ $c.sessionTtlS | quote }}
- name: SPECMESH_HTTP_PORT
  value: {{ $c.httpPort | quote }}
- name: SPECMESH_RPC_TIMEOUT_S
  value: {{ $c.rpcTimeoutS | quote }}
{{- else }}
- name: SPECMESH_MODEL
  value: {{ required (printf "%s.config.model is required" .tier) $c.model | quote }}
- name: SPECMESH_DEVICE
  value: {{ $c.device | quote }}
- name: SPECMESH_DTYPE
  value: {{ $c.dtype | quote }}
- name: SPECMESH_MAX_SESSIONS
  value: {{ $c.maxSessions | quote }}
- name: SPECMESH_MAX_DRAFT_TOKENS
  value: {{ $c.maxDraftTokens | quote }}
- name: SPECMESH_MAX_QUEUE
  value: {{ $c.maxQueue | quote }}
- name: SPECMESH_MAX_BATCH
  value: {{ $c.maxBatch | quote }}
- name: SPECMESH_THREADS
  value: {{ $c.threads | quote }}
- name: SPECMESH_PREFIX_CACHE_MB
  value: {{ $c.prefixCacheMb | quote }}
- name: SPECMESH_PREFIX_BLOCK
  value: {{ $c.prefixBlock | quote }}
- name: SPECMESH_PREFILL_CHUNK
  value: {{ $c.prefillChunk | quote }}
- name: SPECMESH_PREFILL_THREADS
  value: {{ $c.prefillThreads | quote }}
{{- if eq .tier "verifier" }}
- name: SPECMESH_PLAIN_THREADS
  value: {{ $c.plainThreads | quote }}
- name: SPECMESH_LOCAL_DRAFTER
  value: {{ $c.localDrafter | quote }}
- name: SPECMESH_LOCAL_DRAFT_TOKENS
  value: {{ $c.localDraftTokens | quote }}
- name: SPECMESH_LOCAL_DRAFT_SESSIONS
  value: {{ $c.localDraftSessions | quote }}
{{- end }}
{{- /* the address gateways dial (an EndpointSlice's pod IP), under which the pod registers
       and publishes its prefix index in Redis */}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: SPECMESH_ADVERTISE
  value: {{ printf "$(POD_IP):%d" (int $v.service.port) | quote }}
{{- end }}
{{- if $root.Values.security.tls.secretName }}
- name: SPECMESH_TLS_CERT
  value: /etc/specmesh/tls/tls.crt
- name: SPECMESH_TLS_KEY
  value: /etc/specmesh/tls/tls.key
- name: SPECMESH_TLS_CA
  value: /etc/specmesh/tls/ca.crt
- name: SPECMESH_HEALTH_PORT
  value: {{ $root.Values.security.tls.healthPort | quote }}
{{- end }}
{{- if and (eq .tier "gateway") $root.Values.security.apiKeysSecret }}
- name: SPECMESH_API_KEYS
  value: /etc/specmesh/api-keys/keys.json
{{- end }}
- name: HOME
  value: /tmp
- name: HF_HOME
  value: /cache/huggingface
- name: XDG_CACHE_HOME
  value: /cache
{{- with $root.Values.otel }}
{{- if .endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ .protocol | quote }}
- name: OTEL_SERVICE_NAME
  value: {{ printf "specmesh-%s" $.tier | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ .sampler | quote }}
{{- if ne (toString .samplerArg) "" }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ .samplerArg | quote }}
{{- end }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ printf "service.namespace=%s,k8s.namespace.name=%s,deployment.environment=%s" $root.Release.Name $root.Release.Namespace .environment | quote }}
{{- end }}
{{- end }}
{{- with $v.env }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* A tier's Deployment. */}}
{{- define "specmesh.deployment" -}}
{{- $root := .root }}
{{- $tier := .tier }}
{{- $v := index $root.Values $tier }}
{{- $ctx := dict "root" $root "component" $tier }}
{{- $resources := deepCopy ($v.resources | default dict) }}
{{- range $section := list "limits" "requests" }}
{{- if and (ne $tier "verifier") (hasKey (index $resources $section | default dict) "nvidia.com/gpu") }}
{{- fail (printf "%s.resources.%s: only verifiers request nvidia.com/gpu" $tier $section) }}
{{- end }}
{{- end }}
{{- if and (eq $tier "verifier") (gt (int $v.gpus) 0) }}
{{- $limits := $resources.limits | default dict }}
{{- $_ := set $limits "nvidia.com/gpu" (int $v.gpus) }}
{{- $_ := set $resources "limits" $limits }}
{{- $requests := $resources.requests | default dict }}
{{- $_ := set $requests "nvidia.com/gpu" (int $v.gpus) }}
{{- $_ := set $resources "requests" $requests }}
{{- end }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "specmesh.componentName" $ctx }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "specmesh.labels" $ctx | nindent 4 }}
spec:
  {{- if not $v.autoscaling.enabled }}
  replicas: {{ $v.replicaCount }}
  {{- end }}
  revisionHistoryLimit: 5
  {{- with $v.strategy }}
  strategy:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "specmesh.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "specmesh.labels" $ctx | nindent 8 }}
        {{- with $v.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $v.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      {{- if eq $tier "gateway" }}
      serviceAccountName: {{ include "specmesh.gatewayServiceAccountName" $root }}
      automountServiceAccountToken: true
      {{- else }}
      serviceAccountName: {{ include "specmesh.workloadServiceAccountName" $root }}
      automountServiceAccountToken: false
      {{- end }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
      securityContext:
        {{- toYaml $v.podSecurityContext | nindent 8 }}
      containers:
        - name: {{ $tier }}
          image: {{ include "specmesh.image" (dict "root" $root "image" $v.image "tier" $tier) }}
          imagePullPolicy: {{ $v.image.pullPolicy }}
          command: ["specmesh", {{ $tier | quote }}]
          ports:
            - name: grpc
              containerPort: {{ $v.service.port }}
              protocol: TCP
            {{- if and (eq $tier "gateway") $v.config.httpPort }}
            - name: http
              containerPort: {{ $v.config.httpPort }}
              protocol: TCP
            {{- end }}
            - name: metrics
              containerPort: {{ $root.Values.serviceMonitor.port }}
              protocol: TCP
          env:
            {{- include "specmesh.env" (dict "root" $root "tier" $tier) | trim | nindent 12 }}
          {{- $probePort := ternary $root.Values.security.tls.healthPort $v.service.port (ne $root.Values.security.tls.secretName "") }}
          {{- if $v.probes.startup.enabled }}
          startupProbe:
            grpc:
              port: {{ $probePort }}
            {{- toYaml (omit $v.probes.startup "enabled") | nindent 12 }}
          {{- end }}
          livenessProbe:
            grpc:
              port: {{ $probePort }}
            {{- toYaml $v.probes.liveness | nindent 12 }}
          readinessProbe:
            grpc:
              port: {{ $probePort }}
            {{- toYaml $v.probes.readiness | nindent 12 }}
          lifecycle:
            preStop:
              sleep:
                seconds: {{ $v.preStopSleepSeconds }}
          {{- with $resources }}
          resources:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          securityContext:
            {{- toYaml $v.securityContext | nindent 12 }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            - name: cache
              mountPath: /cache
            - name: models
              mountPath: {{ $v.models.mountPath }}
              readOnly: true
            {{- if $root.Values.security.tls.secretName }}
            - name: tls
              mountPath: /etc/specmesh/tls
              readOnly: true
            {{- end }}
            {{- if and (eq $tier "gateway") $root.Values.security.apiKeysSecret }}
            - name: api-keys
              mountPath: /etc/specmesh/api-keys
              readOnly: true
            {{- end }}
      volumes:
        {{- with $root.Values.security.tls.secretName }}
        - name: tls
          secret:
            secretName: {{ . }}
            defaultMode: 0440
        {{- end }}
        {{- if and (eq $tier "gateway") $root.Values.security.apiKeysSecret }}
        - name: api-keys
          secret:
            secretName: {{ $root.Values.security.apiKeysSecret }}
            defaultMode: 0440
        {{- end }}
        - name: tmp
          emptyDir:
            sizeLimit: {{ $v.tmpSizeLimit }}
        - name: cache
          emptyDir:
            sizeLimit: {{ $v.cacheSizeLimit }}
        - name: models
          {{- if $v.models.existingClaim }}
          persistentVolumeClaim:
            claimName: {{ $v.models.existingClaim }}
            readOnly: true
          {{- else }}
          emptyDir:
            sizeLimit: {{ $v.models.sizeLimit }}
          {{- end }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end }}

{{/* A tier's Service: the gateway's is ClusterIP (or the configured type); drafters and
verifiers get headless Services so the gateway reaches each pod (session affinity). */}}
{{- define "specmesh.service" -}}
{{- $root := .root }}
{{- $tier := .tier }}
{{- $v := index $root.Values $tier }}
{{- $ctx := dict "root" $root "component" $tier }}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "specmesh.componentName" $ctx }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "specmesh.labels" $ctx | nindent 4 }}
  {{- with $v.service.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- if eq $tier "gateway" }}
  type: {{ $v.service.type }}
  {{- else }}
  type: ClusterIP
  clusterIP: None
  publishNotReadyAddresses: false
  {{- end }}
  selector:
    {{- include "specmesh.selectorLabels" $ctx | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $v.service.port }}
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
    {{- if and (eq $tier "gateway") $v.config.httpPort }}
    - name: http
      port: {{ $v.config.httpPort }}
      targetPort: http
      protocol: TCP
      appProtocol: {{ ternary "https" "http" (ne $root.Values.security.tls.secretName "") }}
    {{- end }}
    {{- if $root.Values.serviceMonitor.enabled }}
    - name: metrics
      port: {{ $root.Values.serviceMonitor.port }}
      targetPort: {{ $root.Values.serviceMonitor.port }}
      protocol: TCP
    {{- end }}
{{- end }}

{{/* A tier's HorizontalPodAutoscaler (autoscaling/v2), targeting that tier's Deployment. */}}
{{- define "specmesh.hpa" -}}
{{- $root := .root }}
{{- $tier := .tier }}
{{- $v := index $root.Values $tier }}
{{- $ctx := dict "root" $root "component" $tier }}
{{- if $v.autoscaling.enabled }}
{{- if not (or $v.autoscaling.targetCPUUtilizationPercentage $v.autoscaling.metrics) }}
{{- fail (printf "%s.autoscaling: set targetCPUUtilizationPercentage or metrics" $tier) }}
{{- end }}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "specmesh.componentName" $ctx }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "specmesh.labels" $ctx | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "specmesh.componentName" $ctx }}
  minReplicas: {{ $v.autoscaling.minReplicas }}
  maxReplicas: {{ $v.autoscaling.maxReplicas }}
  metrics:
    {{- if $v.autoscaling.targetCPUUtilizationPercentage }}
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ $v.autoscaling.targetCPUUtilizationPercentage }}
    {{- end }}
    {{- with $v.autoscaling.metrics }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $v.autoscaling.behavior }}
  behavior:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
{{- end }}

{{/* A tier's PodDisruptionBudget. */}}
{{- define "specmesh.pdb" -}}
{{- $root := .root }}
{{- $tier := .tier }}
{{- $v := index $root.Values $tier }}
{{- $ctx := dict "root" $root "component" $tier }}
{{- if $v.pdb.enabled }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "specmesh.componentName" $ctx }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "specmesh.labels" $ctx | nindent 4 }}
spec:
  {{- if ne (toString $v.pdb.minAvailable) "" }}
  minAvailable: {{ $v.pdb.minAvailable }}
  {{- else }}
  maxUnavailable: {{ $v.pdb.maxUnavailable | default 1 }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "specmesh.selectorLabels" $ctx | nindent 6 }}
{{- end }}
{{- end }}

{{/* A tier's NetworkPolicy: the gateway accepts clients (networkPolicy.gatewayFrom; all when
empty), drafters and verifiers accept only gateway pods of this release. */}}
{{- define "specmesh.networkPolicy" -}}
{{- $root := .root }}
{{- $tier := .tier }}
{{- $v := index $root.Values $tier }}
{{- $ctx := dict "root" $root "component" $tier }}
{{- if $root.Values.networkPolicy.enabled }}
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: {{ include "specmesh.componentName" $ctx }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "specmesh.labels" $ctx | nindent 4 }}
spec:
  podSelector:
    matchLabels:
      {{- include "specmesh.selectorLabels" $ctx | nindent 6 }}
  policyTypes: [Ingress]
  ingress:
    - ports:
        - port: {{ $v.service.port }}
          protocol: TCP
        {{- if and (eq $tier "gateway") $v.config.httpPort }}
        - port: {{ $v.config.httpPort }}
          protocol: TCP
        {{- end }}
      {{- if eq $tier "gateway" }}
      {{- with $root.Values.networkPolicy.gatewayFrom }}
      from:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- else }}
      from:
        - podSelector:
            matchLabels:
              {{- include "specmesh.selectorLabels" (dict "root" $root "component" "gateway") | nindent 14 }}
      {{- end }}
    {{- if $root.Values.serviceMonitor.enabled }}
    - ports:
        - port: {{ $root.Values.serviceMonitor.port }}
          protocol: TCP
      {{- with $root.Values.networkPolicy.metricsFrom }}
      from:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    {{- end }}
{{- end }}
{{- end }}
