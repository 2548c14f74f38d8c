{{/* Names */}}
{{- define "tally.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tally.webhook" -}}{{ include "tally.fullname" . }}-webhook{{- end -}}
{{- define "tally.aggregator" -}}{{ include "tally.fullname" . }}-aggregator{{- end -}}
{{- define "tally.aggregatorUser" -}}system:serviceaccount:{{ .Release.Namespace }}:{{ include "tally.aggregator" . }}{{- end -}}
{{- define "tally.tlsSecret" -}}
{{- if eq .Values.certificates.mode "secret" }}{{ .Values.certificates.secret.name }}{{ else }}{{ include "tally.webhook" . }}-tls{{ end -}}
{{- end -}}

{{- define "tally.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "tally.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "tally.image" -}}
{{- if .Values.image.tag -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- else if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Chart.AppVersion }}
{{- end -}}
{{- end -}}

{{/* The config file both components read (pkg/config). */}}
{{- define "tally.config" -}}
parents:
{{- range .Values.parents }}
  - group: {{ .group | default "" | quote }}
    version: {{ .version }}
    kind: {{ .kind }}
    resource: {{ .resource }}
    {{- with .counts }}
    counts:
      {{- range $count, $path := . }}
      {{ $count }}: {{ $path }}
      {{- end }}
    {{- end }}
    {{- with .ledger }}
    ledger: {{ . }}
    {{- end }}
    {{- with .customCounts }}
    customCounts:
      {{- range . }}
      - name: {{ .name | toJson }}
        path: {{ .path | toJson }}
        expression: {{ .expression | toJson }}
      {{- end }}
    {{- end }}
    {{- with .compare }}
    compare:
      {{- range $count, $path := . }}
      {{ $count | toJson }}: {{ $path | toJson }}
      {{- end }}
    {{- end }}
{{- end }}
verifyOwner: {{ .Values.verifyOwner }}
namespaceSelector:
  {{- include "tally.namespaceSelector" . | nindent 2 }}
{{- end -}}

{{/*
The namespaces whose pods tally stamps: the webhook registration's
namespaceSelector, which the aggregator's backfill sweep follows too (it
reads it from the config). kube-system and the release namespace are always
excluded: tally's own pods never reach its webhook. With `namespaces`, the
selector lists them by name and nothing else, which tells the binaries to
watch only those (config.Config.FixedNamespaces).
*/}}
{{- define "tally.namespaceSelector" -}}
{{- if .Values.namespaces -}}
{{- if or .Values.webhook.namespaceSelector.matchLabels .Values.webhook.namespaceSelector.matchExpressions -}}
{{- fail "namespaces and webhook.namespaceSelector cannot both be set: namespaces is the webhook's namespaceSelector (kubernetes.io/metadata.name In the list)" -}}
{{- end -}}
{{- range .Values.namespaces -}}
{{- if or (eq . "kube-system") (eq . $.Release.Namespace) -}}
{{- fail (printf "namespaces: %s cannot be listed: tally never tracks the pods of kube-system or of its own namespace" .) -}}
{{- end -}}
{{- end -}}
matchExpressions:
  - key: kubernetes.io/metadata.name
    operator: In
    values: {{ .Values.namespaces | toJson }}
{{- else -}}
matchExpressions:
  - key: kubernetes.io/metadata.name
    operator: NotIn
    values: ["kube-system", {{ .Release.Namespace | quote }}]
  {{- with .Values.webhook.namespaceSelector.matchExpressions }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with .Values.webhook.namespaceSelector.matchLabels }}
matchLabels:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
{{- end -}}

{{/*
A match condition of the webhook registration, given (list $ name): the CEL
of files/match-conditions/<name>.cel with the parent kinds and verifyOwner
filled in. pkg/mutate.MatchConditions renders the same files from the same
config; test/chart checks that they agree.
*/}}
{{- define "tally.matchCondition" -}}
{{- $root := index . 0 -}}
{{- $parents := list -}}
{{- range $root.Values.parents -}}
{{- $counts := .counts | default dict -}}
{{- $finalizer := ternary "tally.dev/tracking" "" (or (hasKey $counts "completedTotal") (hasKey $counts "unexpectedTotal")) -}}
{{- $parents = append $parents (printf "{'group': '%s', 'kind': '%s', 'finalizer': '%s'}" (.group | default "") .kind $finalizer) -}}
{{- end -}}
{{- $root.Files.Get (printf "files/match-conditions/%s.cel" (index . 1)) | trim | replace "@parents@" (printf "[%s]" (join ", " $parents)) | replace "@verifyOwner@" (toString $root.Values.verifyOwner) -}}
{{- end -}}

{{/*
The aggregator's replicas: aggregator.replicas, else 2 when a parent kind
keeps totals and leader election is on (a finished pod's deletion waits for a
running aggregator; a standby takes over within the lease's duration), else 1.
*/}}
{{- define "tally.aggregatorReplicas" -}}
{{- $totals := false -}}
{{- range .Values.parents -}}
{{- $counts := .counts | default dict -}}
{{- if or (hasKey $counts "completedTotal") (hasKey $counts "unexpectedTotal") -}}{{- $totals = true -}}{{- end -}}
{{- end -}}
{{- if kindIs "invalid" .Values.aggregator.replicas -}}
{{- ternary 2 1 (and $totals .Values.aggregator.leaderElect) -}}
{{- else -}}
{{- .Values.aggregator.replicas -}}
{{- end -}}
{{- end -}}

{{/*
A component's PodDisruptionBudget, rendered only when it protects a pod and
a drain can satisfy it: budget.minAvailable (a number, or a percentage of
the replicas rounded up as the disruption controller does) above 0 and
below the replicas. A running pod that is not ready (say while the API
server is degraded) may always be evicted; a ready replica beside one that
is not still holds a drain until the other is ready.
*/}}
{{- define "tally.podDisruptionBudget" -}}
{{- $replicas := int .replicas -}}
{{- $min := .budget.minAvailable -}}
{{- $need := 0 -}}
{{- if kindIs "string" $min -}}
{{- $need = div (add (mul (int (trimSuffix "%" $min)) $replicas) 99) 100 -}}
{{- else -}}
{{- $need = int $min -}}
{{- end -}}
{{- if and .budget.enabled (not (kindIs "invalid" $min)) (gt (int $need) 0) (lt (int $need) $replicas) }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "tally.fullname" .root }}-{{ .component }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "tally.labels" .root | nindent 4 }}
spec:
  minAvailable: {{ $min }}
  unhealthyPodEvictionPolicy: AlwaysAllow
  selector:
    matchLabels:
      {{- include "tally.selector" (dict "root" .root "component" .component) | nindent 6 }}
{{- end }}
{{- end -}}

{{/* RBAC rules on the parent kinds, grouped by API group. */}}
{{- define "tally.parentRules" -}}
{{- $groups := dict -}}
{{- range .root.Values.parents -}}
{{- $g := .group | default "" -}}
{{- $_ := set $groups $g (append (get $groups $g | default list) .resource) -}}
{{- end -}}
{{- range $g, $resources := $groups }}
- apiGroups: [{{ $g | quote }}]
  resources: [{{ range $i, $r := $resources }}{{ if $i }}, {{ end }}{{ $r | quote }}{{ end }}]
  verbs: ["get", "list", "watch"]
{{- if $.status }}
- apiGroups: [{{ $g | quote }}]
  resources: [{{ range $i, $r := $resources }}{{ if $i }}, {{ end }}{{ printf "%s/status" $r | quote }}{{ end }}]
  verbs: ["patch"]
{{- end }}
{{- end }}
{{- end -}}

{{/*
The aggregator's rules on pods, parents and Events: a ClusterRole's, or,
with `namespaces`, a Role's in each.
*/}}
{{- define "tally.aggregatorRules" }}
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "patch"]
{{- include "tally.parentRules" (dict "root" . "status" true) }}
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end -}}

{{- define "tally.securityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "tally.dnsNames" -}}
{{- $svc := include "tally.webhook" . -}}
{{- list $svc (printf "%s.%s" $svc .Release.Namespace) (printf "%s.%s.svc" $svc .Release.Namespace) (printf "%s.%s.svc.cluster.local" $svc .Release.Namespace) | toJson -}}
{{- end -}}

{{/*
certificates.mode=helm: a CA and a serving certificate, generated once per
render and reused from the existing Secret on upgrades. Returns YAML with the
base64 fields ca, crt and key.
*/}}
{{- define "tally.helmCerts" -}}
{{- if not (hasKey .Values.certificates.helm "generated") -}}
{{- $secret := lookup "v1" "Secret" .Release.Namespace (include "tally.tlsSecret" .) -}}
{{- if and $secret (hasKey ($secret.data | default dict) "ca.crt") -}}
{{- $_ := set .Values.certificates.helm "generated" (dict "ca" (index $secret.data "ca.crt") "crt" (index $secret.data "tls.crt") "key" (index $secret.data "tls.key")) -}}
{{- else -}}
{{- $days := int .Values.certificates.helm.validityDays -}}
{{- $ca := genCA (printf "%s-ca" (include "tally.webhook" .)) $days -}}
{{- $cert := genSignedCert (include "tally.webhook" .) .Values.certificates.helm.ipAddresses (include "tally.dnsNames" . | fromJsonArray) $days $ca -}}
{{- $_ := set .Values.certificates.helm "generated" (dict "ca" ($ca.Cert | b64enc) "crt" ($cert.Cert | b64enc) "key" ($cert.Key | b64enc)) -}}
{{- end -}}
{{- end -}}
{{- toYaml .Values.certificates.helm.generated -}}
{{- end -}}

{{/* Whole seconds of a Go duration made of h, m and s units (rounded up). */}}
{{- define "tally.seconds" -}}
{{- $d := . | toString -}}
{{- $total := 0.0 -}}
{{- range $part := regexFindAll "[0-9.]+(ms|h|m|s)" $d -1 -}}
{{- $n := regexFind "[0-9.]+" $part | float64 -}}
{{- $unit := regexReplaceAll "[0-9.]+" $part "" -}}
{{- if eq $unit "h" }}{{ $total = addf $total (mulf $n 3600) }}{{ else if eq $unit "m" }}{{ $total = addf $total (mulf $n 60) }}{{ else if eq $unit "s" }}{{ $total = addf $total $n }}{{ else }}{{ $total = addf $total (divf $n 1000) }}{{ end -}}
{{- end -}}
{{- ceil $total | int -}}
{{- end -}}
