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

{{/* The tag of all four images: image.tag, else the chart's appVersion. */}}
{{- define "flowprefill.imageTag" -}}
{{- default .Chart.AppVersion .Values.image.tag -}}
{{- end -}}

{{/* An image of the naming contract, <image.registry>/<name>:<tag> (docs/images.md);
called with (list $ "name"). */}}
{{- define "flowprefill.contractImage" -}}
{{- $root := index . 0 -}}
{{- printf "%s/%s:%s" (trimSuffix "/" $root.Values.image.registry) (index . 1) (include "flowprefill.imageTag" $root) -}}
{{- end -}}

{{/* The operator's image: image.repository (else <registry>/operator), by digest if set. */}}
{{- define "flowprefill.image" -}}
{{- $repository := default (printf "%s/operator" (trimSuffix "/" .Values.image.registry)) .Values.image.repository -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" $repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repository (include "flowprefill.imageTag" .) -}}
{{- end -}}
{{- end -}}

{{/* A child image: children.<role>Image if set, else the contract's; called with
(list $ "prefill"). */}}
{{- define "flowprefill.childImage" -}}
{{- $root := index . 0 -}}
{{- $role := index . 1 -}}
{{- default (include "flowprefill.contractImage" (list $root $role)) (get $root.Values.children (printf "%sImage" $role)) -}}
{{- end -}}

{{/* Names of the children's imagePullSecrets, comma-separated (the operator's
FLOWPREFILL_OPERATOR_CHILD_IMAGE_PULL_SECRETS): children.imagePullSecrets, or when that
is null the chart's own imagePullSecrets. */}}
{{- define "flowprefill.childPullSecrets" -}}
{{- $secrets := .Values.children.imagePullSecrets -}}
{{- if kindIs "invalid" $secrets -}}
{{- $secrets = .Values.imagePullSecrets -}}
{{- end -}}
{{- $names := list -}}
{{- range $secrets -}}
{{- $names = append $names .name -}}
{{- end -}}
{{- join "," $names -}}
{{- end -}}

{{/* Whether ServingPools may set spec.model.image on the cluster being installed to
(modelSources.imageVolumes): "true" or "false". The ImageVolume feature is on by default
from Kubernetes 1.35; a feature gate (alpha 1.31, beta off by default 1.33-1.34) before. */}}
{{- define "flowprefill.imageVolumesAllowed" -}}
{{- $mode := .Values.modelSources.imageVolumes -}}
{{- if eq $mode "enabled" -}}
{{- if semverCompare "<1.31.0-0" .Capabilities.KubeVersion.Version -}}
{{- fail (printf "modelSources.imageVolumes=enabled: Kubernetes %s has no ImageVolume feature (it appeared in 1.31)" .Capabilities.KubeVersion.Version) -}}
{{- end -}}
true
{{- else if eq $mode "disabled" -}}
false
{{- else -}}
{{- semverCompare ">=1.35.0-0" .Capabilities.KubeVersion.Version -}}
{{- end -}}
{{- end -}}

{{/* The rules the operator needs in every namespace it serves: a Role's in namespaced
mode, the ClusterRole's in cluster mode. Every kind the operator reads or builds
(kube.py's RESOURCES, the builders' children); tests/operator/test_operator_helm.py holds
them against the list of what the operator does. */}}
{{- define "flowprefill.namespacedRules" -}}
- apiGroups: ["flowprefill.io"]
  resources: ["servingpools", "sloclasses"]
  verbs: ["get", "list", "watch", "patch"]
# Children carry an ownerReference to their pool with blockOwnerDeletion: true; with the
# OwnerReferencesPermissionEnforcement admission plugin (OpenShift enables it) setting that
# needs update on the owner's finalizers subresource, or every create is a 403.
- apiGroups: ["flowprefill.io"]
  resources: ["servingpools/finalizers"]
  verbs: ["update"]
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
# The gateway's optional children: a PodDisruptionBudget, a HorizontalPodAutoscaler and a
# Gateway API HTTPRoute to its Service (created, kept in shape, deleted when turned off).
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: ["gateway.networking.k8s.io"]
  resources: ["httproutes"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list"]
# Secrets are read by name only (never listed or watched): a pool's model.tokenSecretRef
# and the API-key Secrets an SLOClass's claims name. rbac.secretNames narrows get to
# those names.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get"]
  {{- with .Values.rbac.secretNames }}
  resourceNames: {{ toJson . }}
  {{- end }}
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
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
{{/* The launcher's probe port in a colocated pool's pods (flowprefill_operator.colocated). */}}
{{- define "flowprefill.colocatedHealthPort" -}}8400{{- end -}}

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

{{/* The port of the Hub the operator checks hf:// sources at: modelSources.hfEndpoint's
(explicit, else 80 for http), 443 for the Hub itself. */}}
{{- define "flowprefill.hubPort" -}}
{{- $endpoint := .Values.modelSources.hfEndpoint -}}
{{- if $endpoint -}}
{{- $url := urlParse $endpoint -}}
{{- $hostPort := splitList ":" $url.host -}}
{{- if gt (len $hostPort) 1 -}}
{{- last $hostPort -}}
{{- else if eq $url.scheme "http" -}}
80
{{- else -}}
443
{{- end -}}
{{- else -}}
443
{{- end -}}
{{- end -}}
