{{- define "flowprefill.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "flowprefill.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "flowprefill.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "flowprefill.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "flowprefill.labels" -}}
app.kubernetes.io/name: {{ include "flowprefill.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "flowprefill.selectorLabels" -}}
app.kubernetes.io/name: {{ include "flowprefill.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "flowprefill.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "flowprefill.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Namespaces watched in namespaced mode (the release namespace by default). */}}
{{- define "flowprefill.watchedNamespaces" -}}
{{- if .Values.watch.namespaces -}}
{{- join "," .Values.watch.namespaces -}}
{{- else -}}
{{- .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{- define "flowprefill.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The rules the operator needs in every namespace it serves. */}}
{{- define "flowprefill.namespacedRules" -}}
- apiGroups: ["flowprefill.io"]
  resources: ["servingpools", "sloclasses"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["flowprefill.io"]
  resources: ["servingpools/status", "sloclasses/status"]
  verbs: ["get", "patch"]
# The autoscaler writes replicas of pools it owns through /scale, as kubectl scale does.
- apiGroups: ["flowprefill.io"]
  resources: ["servingpools/scale"]
  verbs: ["get", "patch"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services", "configmaps"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list"]
- apiGroups: [""]
  resources: ["secrets", "persistentvolumeclaims"]
  verbs: ["get"]
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end -}}

{{- define "flowprefill.peeringRules" -}}
- apiGroups: ["kopf.dev"]
  resources: [{{ if eq .Values.watch.scope "cluster" }}"clusterkopfpeerings"{{ else }}"kopfpeerings"{{ end }}]
  verbs: ["get", "list", "watch", "patch"]
{{- end -}}

{{/* Ports of the pods the operator creates: flowprefill/contracts/deployment.py
(GATEWAY_PORT, PREFILL_PORT, DECODE_PORT, PREFILL_KV_PORT); a test checks the two agree.
Each serves its API and /metrics on its one port; prefill pods with the http KV transport
also serve KV hand-offs to decode on prefillKvPort. */}}
{{- define "flowprefill.gatewayPort" -}}8000{{- end -}}
{{- define "flowprefill.prefillPort" -}}8100{{- end -}}
{{- define "flowprefill.decodePort" -}}8200{{- end -}}
{{- define "flowprefill.prefillKvPort" -}}8300{{- end -}}

{{/* Namespaces that get the workload NetworkPolicies: the watched ones in namespaced mode;
networkPolicy.namespaces (else the release namespace) in cluster mode, where the chart
cannot know every namespace the operator will serve. */}}
{{- define "flowprefill.policyNamespaces" -}}
{{- if ne .Values.watch.scope "cluster" -}}
{{- include "flowprefill.watchedNamespaces" . -}}
{{- else if .Values.networkPolicy.namespaces -}}
{{- join "," .Values.networkPolicy.namespaces -}}
{{- else -}}
{{- .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{/* Pods of one role the operator created (builders/common.py: component_labels). */}}
{{- define "flowprefill.childSelector" -}}
matchLabels:
  app.kubernetes.io/managed-by: flowprefill-operator
  flowprefill.io/role: {{ . }}
{{- end -}}
