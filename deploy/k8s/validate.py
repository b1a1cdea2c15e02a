"""Offline validation of deploy/k8s/ (no cluster needed):

    pip install -e ".[deploy]"
    python deploy/k8s/validate.py

1. every core object (Deployment, Service, PVC, PDB, HPA, ConfigMap) against Kubernetes' OpenAPI schemas, strict
   (an unknown field fails), with kubernetes-validate;
2. the custom resources (KEDA's ScaledObject, the Prometheus operator's ServiceMonitor) against JSON schemas of
   their CRDs: cloudcoil-models-keda and cloudcoil-models-prometheus-operator (PyPI) are pydantic models generated
   from those CRDs; their JSON schema, made strict (no unknown field in any object), is checked with jsonschema;
3. with kubectl on PATH: `kubectl kustomize` builds kustomization.yaml, and `kubectl label --local --dry-run=client`
   decodes every object as kubectl would apply it. (`kubectl apply --dry-run=client` needs the API server's
   discovery even with --validate=false, so it cannot run without a cluster.)

Exit status 1 on the first kind of failure; every problem is printed. tests/deploy/test_k8s_manifests.py runs 1
and 2 (the CRD models are in the test extra too) and checks every flag, probe, port and metric name against the code.
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
CRD_MODELS = {
    ("keda.sh/v1alpha1", "ScaledObject"): ("cloudcoil.models.keda.v1alpha1", "ScaledObject"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"): ("cloudcoil.models.prometheus_operator.v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PodMonitor"): ("cloudcoil.models.prometheus_operator.v1", "PodMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"): ("cloudcoil.models.prometheus_operator.v1", "PrometheusRule"),
}
KUBERNETES_VERSION = "1.30.0"
"""The oldest Kubernetes the manifests are for (policy/v1 PDBs and autoscaling/v2 HPAs are GA since 1.21 and 1.23)."""


def manifest_files() -> list[Path]:
    return sorted(p for p in HERE.rglob("*.yaml") if p.name != "kustomization.yaml")


def objects() -> list[tuple[Path, dict]]:
    found = []
    for path in manifest_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                found.append((path, doc))
    return found


def is_custom(doc: dict) -> bool:
    return (doc["apiVersion"], doc["kind"]) in CRD_MODELS


def validate_core(doc: dict, version: str = KUBERNETES_VERSION) -> list[str]:
    """Strict validation against Kubernetes' schemas; the error messages (empty: valid)."""
    import kubernetes_validate

    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'.'.join(str(p) for p in e.path)}: {e.message}"]
    return []


def strict(node):
    """The JSON schema with additionalProperties false on every object that lists its properties."""
    if isinstance(node, dict):
        if node.get("type") == "object" and "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for value in node.values():
            strict(value)
    elif isinstance(node, list):
        for value in node:
            strict(value)
    return node


def crd_schema(api_version: str, kind: str) -> dict:
    module_name, cls_name = CRD_MODELS[(api_version, kind)]
    model = getattr(importlib.import_module(module_name), cls_name)
    return strict(model.model_json_schema(by_alias=True, mode="validation"))


def validate_custom(doc: dict) -> list[str]:
    import jsonschema

    schema = crd_schema(doc["apiVersion"], doc["kind"])
    return [f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
            for e in jsonschema.Draft202012Validator(schema).iter_errors(doc)]


def kubectl_checks() -> list[str]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return []
    problems = []
    built = subprocess.run([kubectl, "kustomize", str(HERE)], capture_output=True, text=True, timeout=60)
    if built.returncode:
        problems.append(f"kubectl kustomize: {built.stderr.strip()}")
    files = [arg for path in manifest_files() for arg in ("-f", str(path))]
    decoded = subprocess.run([kubectl, "label", "--local", "--dry-run=client", "-o", "name", *files,
                              "validated=true"], capture_output=True, text=True, timeout=60)
    if decoded.returncode:
        problems.append(f"kubectl label --local: {decoded.stderr.strip()}")
    else:
        print(f"kubectl decoded {len(decoded.stdout.split())} objects; kustomize built "
              f"{built.stdout.count(chr(10) + 'kind:') + built.stdout.startswith('kind:')} objects")
    return problems


def main() -> int:
    failed = False
    for path, doc in objects():
        name = f"{path.relative_to(HERE)}: {doc['kind']}/{doc['metadata']['name']}"
        problems = validate_custom(doc) if is_custom(doc) else validate_core(doc)
        source = "CRD schema (cloudcoil models)" if is_custom(doc) else f"Kubernetes {KUBERNETES_VERSION} strict"
        print(f"{'FAIL' if problems else 'ok'}  {name} against {source}")
        for problem in problems:
            print(f"      {problem}")
        failed |= bool(problems)
    for problem in kubectl_checks():
        print(f"FAIL  {problem}")
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
