"""RBAC authorization for tests/kube_emulator.py: Kubernetes' rules, applied to service-account tokens.

A token registered with :meth:`RbacAuthorizer.add_service_account` authenticates as
``system:serviceaccount:NS:NAME``; each of its requests is allowed only if a rule of a
Role / ClusterRole stored in the emulator, bound to it by a RoleBinding / ClusterRoleBinding,
grants the verb on the resource (the same evaluation as the API server's RBAC authorizer:
ClusterRoleBindings grant everywhere, RoleBindings only in their namespace; ``*``
wildcards, subresources as ``resource/sub``, ``resourceNames``).  A request outside
them gets ``403 Forbidden`` with the API server's message.  Discovery and OpenAPI
paths are open to every authenticated user (``system:discovery``).  Other tokens
(the tests' own kubeconfig) are cluster admins.

Every decision about a service account is kept in ``decisions`` for tests to assert on
(what was denied, which watches carried which selectors).  Like the API server, it also refuses a
Role, or a binding to one, that grants more than its author holds (RBAC escalation prevention).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from kube_emulator_api import ApiError, Target

RBAC = "rbac.authorization.k8s.io/v1"
# HTTP method -> verb (GET and DELETE depend on whether a name is addressed; ?watch=true is "watch").
_VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch"}


@dataclass(frozen=True)
class Decision:
    user: str
    verb: str
    group: str
    resource: str  # "deployments" or "inferenceservices/status"
    namespace: Optional[str]
    name: Optional[str]
    params: tuple[tuple[str, str], ...]
    allowed: bool


def verb_of(method: str, target: Target, params: dict[str, str]) -> str:
    if method == "GET":
        if params.get("watch") in ("true", "1"):
            return "watch"
        return "get" if target.name else "list"
    if method == "DELETE":
        return "delete" if target.name else "deletecollection"
    return _VERBS.get(method, method.lower())


def _name_of(body: Any) -> str:
    return str(((body or {}).get("metadata") or {}).get("name", "")) if isinstance(body, dict) else ""


def _rule_allows(rule: dict, verb: str, group: str, resource: str, name: Optional[str]) -> bool:
    if not ({"*", verb} & set(rule.get("verbs") or [])):
        return False
    if not ({"*", group} & set(rule.get("apiGroups") or [])):
        return False
    resources = set(rule.get("resources") or [])
    main, _, sub = resource.partition("/")
    if not ({"*", resource} & resources or (sub and f"*/{sub}" in resources)):
        return False
    names = rule.get("resourceNames") or []
    return not names or (name is not None and name in names)


class RbacAuthorizer:
    """Evaluates RBAC for service-account tokens against the objects stored in ``emulator``."""

    def __init__(self, emulator: Any):
        self._emulator = emulator
        self._tokens: dict[str, tuple[str, str]] = {}
        self.decisions: list[Decision] = []

    def add_service_account(self, token: str, namespace: str, name: str) -> None:
        self._tokens[token] = (namespace, name)

    def _subject_matches(self, subject: dict, sa_ns: str, sa_name: str) -> bool:
        kind = subject.get("kind")
        if kind == "ServiceAccount":
            return subject.get("name") == sa_name and subject.get("namespace") == sa_ns
        if kind == "User":
            return subject.get("name") == f"system:serviceaccount:{sa_ns}:{sa_name}"
        if kind == "Group":
            groups = ("system:serviceaccounts", f"system:serviceaccounts:{sa_ns}", "system:authenticated")
            return subject.get("name") in groups
        return False

    def _role_rules(self, ref: dict, binding_ns: Optional[str]) -> list[dict]:
        if ref.get("kind") == "ClusterRole":
            objs = self._emulator.objects_of(RBAC, "clusterroles")
        else:
            objs = self._emulator.objects_of(RBAC, "roles", binding_ns)
        for obj in objs:
            if obj["metadata"]["name"] == ref.get("name"):
                return list(obj.get("rules") or [])
        return []

    def rules_for(self, sa_ns: str, sa_name: str, namespace: Optional[str]) -> list[dict]:
        """Every rule that applies to the service account for a request in ``namespace`` (None: cluster scope)."""
        rules: list[dict] = []
        for b in self._emulator.objects_of(RBAC, "clusterrolebindings"):
            if any(self._subject_matches(s, sa_ns, sa_name) for s in b.get("subjects") or []):
                rules += self._role_rules(b.get("roleRef") or {}, None)
        if namespace is not None:
            for b in self._emulator.objects_of(RBAC, "rolebindings", namespace):
                if any(self._subject_matches(s, sa_ns, sa_name) for s in b.get("subjects") or []):
                    rules += self._role_rules(b.get("roleRef") or {}, namespace)
        return rules

    def _escalation(self, sa: tuple[str, str], verb: str, target: Target, body: Any) -> Optional[str]:
        """RBAC's escalation check: a Role (or a RoleBinding to one) may grant only what its author holds
        (the API server's ``escalate`` / ``bind`` verbs would lift this; nothing here grants them)."""
        if verb not in ("create", "update", "patch") or target.group != "rbac.authorization.k8s.io":
            return None
        if not isinstance(body, dict) or target.subresource:
            return None
        if target.plural in ("roles", "clusterroles"):
            granted = body.get("rules")
        elif target.plural in ("rolebindings", "clusterrolebindings") and isinstance(body.get("roleRef"), dict):
            granted = self._role_rules(body["roleRef"], target.namespace)
        else:
            return None
        held = self.rules_for(*sa, target.namespace)
        for rule in granted or []:
            for group in rule.get("apiGroups") or []:
                for resource in rule.get("resources") or []:
                    for v in rule.get("verbs") or []:
                        if not any(_rule_allows(h, v, group, resource, None) for h in held):
                            return f"{v} on {resource!r} in API group {group!r}"
        return None

    def check(
        self,
        headers: dict[str, str],
        method: str,
        target: Optional[Target],
        params: dict[str, str],
        body: Any = None,
    ) -> None:
        """Raise ``ApiError(403)`` when a service-account token asks for something its roles do not grant."""
        auth = headers.get("Authorization") or headers.get("authorization") or ""
        token = auth[len("Bearer ") :] if auth.startswith("Bearer ") else ""
        if token not in self._tokens or target is None or not target.plural:
            return  # the tests' admin, or discovery / OpenAPI (open to every authenticated user)
        sa_ns, sa_name = self._tokens[token]
        user = f"system:serviceaccount:{sa_ns}:{sa_name}"
        verb = verb_of(method.upper(), target, params)
        resource = target.plural + (f"/{target.subresource}" if target.subresource else "")
        # a Namespace object is addressed at cluster scope even though its path names it
        ns = target.namespace
        allowed = any(
            _rule_allows(rule, verb, target.group, resource, target.name) for rule in self.rules_for(sa_ns, sa_name, ns)
        )
        self.decisions.append(
            Decision(user, verb, target.group, resource, ns, target.name, tuple(sorted(params.items())), allowed)
        )
        if allowed:
            escalating = self._escalation((sa_ns, sa_name), verb, target, body)
            if escalating is None:
                return
            self.decisions[-1] = dataclasses.replace(self.decisions[-1], allowed=False)
            raise ApiError(
                403,
                "Forbidden",
                f'{target.plural}.{target.group} "{target.name or _name_of(body)}" is forbidden: user "{user}" is attempting to '
                f"grant RBAC permissions not currently held: {escalating}",
                name=target.name or "",
                kind=target.plural,
            )
        what = f"{target.plural}.{target.group}" if target.group else target.plural
        if target.name:
            what += f' "{target.name}"'
        scope = f'in the namespace "{ns}"' if ns else "at the cluster scope"
        raise ApiError(
            403,
            "Forbidden",
            f'{what} is forbidden: User "{user}" cannot {verb} resource "{resource}" in API group '
            f'"{target.group}" {scope}',
            name=target.name or "",
            kind=target.plural,
        )

    def denied(self) -> list[Decision]:
        return [d for d in self.decisions if not d.allowed]


__all__ = ["RbacAuthorizer", "Decision", "verb_of"]
