{{/* Full name of the release's objects. */}}
{{- define "kvship-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvship-operator.labels" -}}
app.kubernetes.io/name: kvship-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "kvship-operator.selectorLabels" -}}
app.kubernetes.io/name: kvship-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvship-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvship-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Rules on the namespaced resources the operator manages (children of InferenceServices). */}}
{{- define "kvship-operator.namespacedRules" -}}
- apiGroups: ["kvship.io"]
  resources: ["inferenceservices"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["kvship.io"]
  resources: ["inferenceservices/status"]
  verbs: ["get", "patch"]
# Children: the operator reads, lists (by label), creates, patches and deletes them; it watches only
# Deployments and worker-group sets (their status feeds the InferenceService's), with a label selector.
- apiGroups: [""]
  resources: ["configmaps", "services", "serviceaccounts"]
  verbs: ["get", "list", "create", "patch", "delete"]
# deletecollection: an old revision's prefill and decode Deployments go in one request (docs/operator.md).
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete", "deletecollection"]
# Multi-node worker groups (nodesPerReplica > 1): LeaderWorkerSets where installed, else StatefulSets; watched
# (same label selector) so a group's restart and status follow its events.
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete", "deletecollection"]
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete", "deletecollection"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "create", "patch", "delete"]
# Each service's Secrets (<name>-kv-transfer, -worker-key, -admin-key): read by name, created once, patched only
# to rotate; no list (the operator never enumerates the namespace's Secrets) and no delete (owner references do).
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create", "patch"]
# The operator grants routers read access to pods, so it must hold that access itself.
# delete: the StatefulSet fallback of worker groups restarts a whole group when one of its pods is lost.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "delete"]
# The kvship.io/in-rotation readiness gate: the operator sets that one condition on worker pods.
- apiGroups: [""]
  resources: ["pods/status"]
  verbs: ["patch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end -}}

{{/* The namespaces the operator watches when not cluster-wide: watch.namespaces, else the release's. */}}
{{- define "kvship-operator.watchedNamespaces" -}}
{{- if .Values.watch.namespaces -}}
{{- toJson .Values.watch.namespaces -}}
{{- else -}}
{{- toJson (list .Release.Namespace) -}}
{{- end -}}
{{- end -}}
