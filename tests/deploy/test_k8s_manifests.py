"""deploy/k8s/ against the code: every `pagedllm serve` flag of the Deployment parses with the real parser and is
honoured (not one of vLLM's flags pagedllm accepts without effect or refuses), every probe path is a route of the
server that works without the API key, the ports and selectors line up, and every metric name that deploy/ names
(manifests, dashboard, alerts and their unit tests) is one pagedllm exports. A renamed flag, route or metric fails
here. The manifests also validate against Kubernetes' schemas (kubernetes-validate, strict), and the custom
resources against their CRDs' schemas (deploy/k8s/validate.py; the models are in the test extra)."""

from __future__ import annotations

import argparse
import re
from types import SimpleNamespace

import pytest
import yaml
from deploy_files import DEPLOY, load_script, require_module

validate = load_script("k8s/validate.py")
OBJECTS = validate.objects()
METRIC = re.compile(r"\b((?:vllm|pagedllm):[a-zA-Z_][a-zA-Z0-9_:]*)")


def one(kind: str) -> dict:
    found = [doc for _, doc in OBJECTS if doc["kind"] == kind]
    assert len(found) == 1, f"{kind}: {len(found)} objects"
    return found[0]


def container() -> dict:
    (c,) = one("Deployment")["spec"]["template"]["spec"]["containers"]
    return c


def serve_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """`pagedllm` with its `serve` subcommand, and the serve subparser, as the CLI builds them."""
    from pagedllm.entrypoints.cli import serve

    parser = argparse.ArgumentParser(prog="pagedllm")
    return parser, serve.add_parser(parser.add_subparsers(dest="subcommand"))


def serve_args():
    parser, _ = serve_parser()
    c = container()
    assert c["command"] == ["pagedllm", "serve"]
    try:
        return parser.parse_args(["serve", *c["args"]])
    except SystemExit:
        pytest.fail(f"`pagedllm serve` does not parse the Deployment's args: {c['args']}")


def named_port(name: str) -> int:
    return next(p["containerPort"] for p in container()["ports"] if p["name"] == name)


def test_serve_flags_parse_and_are_honoured():
    from pagedllm.config.arguments import configs_from_args, vllm_only_flags_given

    args = serve_args()
    accepted, refused = vllm_only_flags_given(args)
    assert (accepted, refused) == ([], []), "flags pagedllm accepts without effect or refuses"
    _, server = configs_from_args(args)
    assert server.host == "0.0.0.0"
    assert server.port == named_port("http")
    pod = one("Deployment")["spec"]["template"]["spec"]
    pre_stop = container()["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    # SIGTERM drains for --drain-timeout, then aborts and stops the engine (~2 s measured, benchmarks/RESULTS.md)
    assert pod["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + server.drain_timeout + 5
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):  # /health waits up to the health timeout
        assert container()[probe]["timeoutSeconds"] > server.health_check_timeout, probe


def test_probe_paths_are_unguarded_routes_on_the_server_port():
    from fastapi import FastAPI

    from pagedllm.entrypoints.openai import app as app_module
    from pagedllm.entrypoints.openai.middleware import UNGUARDED_PATHS

    app = FastAPI()
    app_module._add_info_routes(app, SimpleNamespace(engine=None, config=None, models=None))
    get_routes = {route.path for route in app.routes if "GET" in getattr(route, "methods", ())}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        http_get = container()[probe]["httpGet"]
        assert http_get["path"] in get_routes, probe
        assert http_get["path"] in UNGUARDED_PATHS, f"{probe}: {http_get['path']} would need the API key"
        assert named_port(http_get["port"]) == named_port("http")


def test_ports_selectors_and_volumes_line_up():
    deployment, service, monitor = one("Deployment"), one("Service"), one("ServiceMonitor")
    pod = deployment["spec"]["template"]
    pod_labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert one("PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (port,) = service["spec"]["ports"]
    named_port(port["targetPort"])
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    assert {e["path"] for e in monitor["spec"]["endpoints"]} == {"/metrics"}
    assert one("ScaledObject")["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert one("HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container()["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    claim = volumes[mounts["/models"]]["persistentVolumeClaim"]["claimName"]
    assert claim == one("PersistentVolumeClaim")["metadata"]["name"]
    env = {e["name"]: e.get("value") for e in container()["env"]}
    assert env["HF_HOME"].startswith("/models/") and env["PAGEDLLM_CACHE_DIR"].startswith("/models/")
    # the alerts select job="pagedllm": the ServiceMonitor's job label is the Service's name
    assert service["metadata"]["name"] == "pagedllm"


def exported_series() -> set[str]:
    """The sample names pagedllm's /metrics can carry: every family with data parallelism, speculative decoding
    and a mixture-of-experts model, as Prometheus stores them (counters with _total, histograms' _bucket ...)."""
    from pagedllm.messages import SpecDecodingStats
    from pagedllm.metrics.prometheus import PrometheusStatLogger

    logger = PrometheusStatLogger("m", cache_config_info={"block_size": "16"}, num_engines=2)
    logger._record_spec_decode(SpecDecodingStats(num_spec_tokens=1, num_drafts=1, num_draft_tokens=1,
                                                 num_accepted_tokens=1, num_accepted_tokens_per_pos=[1]), 0)
    logger._record_routed_tokens([1], 0)
    logger.record_admission_rejection()
    return {sample.name for family in logger.registry.collect() for sample in family.samples}


def promql_in_deploy() -> dict[str, str]:
    """Every PromQL expression and series selector in deploy/ (where -> text): the dashboard's queries and
    variables, the rules, the rules' unit-test series, the autoscalers' queries."""
    import json

    found = {}
    board = json.loads((DEPLOY / "grafana" / "pagedllm.json").read_text())
    for panel in board["panels"]:
        for i, target in enumerate(panel.get("targets", [])):
            found[f"dashboard {panel['title']} #{i}"] = target["expr"]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            found[f"dashboard variable {variable['name']}"] = variable["query"]
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            found[f"rule {rule.get('alert') or rule.get('record')}"] = rule["expr"]
    unit_tests = yaml.safe_load((DEPLOY / "prometheus" / "alerts_test.yaml").read_text())
    for test in unit_tests["tests"]:
        for i, series in enumerate(test["input_series"]):
            found[f"unit test {test['name']} #{i}"] = series["series"]
    for group in one("PrometheusRule")["spec"]["groups"]:
        for rule in group["rules"]:
            found[f"PrometheusRule {rule.get('alert') or rule.get('record')}"] = rule["expr"]
    for trigger in one("ScaledObject")["spec"]["triggers"]:
        found[f"ScaledObject trigger {trigger['name']}"] = trigger["metadata"]["query"]
    adapter = yaml.safe_load(one("ConfigMap")["data"]["config.yaml"])
    for i, rule in enumerate(adapter["rules"]):
        found[f"prometheus-adapter rule #{i}"] = rule["seriesQuery"]
    return found


def test_every_metric_name_in_deploy_is_exported():
    exported = exported_series()
    assert {"vllm:num_requests_waiting", "vllm:time_to_first_token_seconds_bucket",
            "vllm:spec_decode_num_drafts_total"} <= exported
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())
    recorded = {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    queries = promql_in_deploy()
    assert len(queries) >= 60
    unknown = {where: name for where, text in queries.items() for name in METRIC.findall(text)
               if name not in exported | recorded}
    assert unknown == {}
    named = {name for text in queries.values() for name in METRIC.findall(text)}
    assert {"vllm:num_requests_waiting", "vllm:inter_token_latency_seconds_bucket", "vllm:kv_cache_usage_perc"} <= named
    # the custom metrics API's name of the HPA: prometheus-adapter renames vllm:X to vllm_X
    (metric,) = one("HorizontalPodAutoscaler")["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"].replace("vllm_", "vllm:", 1) in exported


def test_core_objects_validate_against_kubernetes_schemas():
    require_module("kubernetes_validate", 'pip install -e ".[test]"')
    core = [(path, doc) for path, doc in OBJECTS if not validate.is_custom(doc)]
    assert len(core) >= 6
    problems = {f"{path.name}: {doc['kind']}": validate.validate_core(doc) for path, doc in core}
    assert problems == {k: [] for k in problems}


def test_core_validation_catches_an_unknown_field():
    require_module("kubernetes_validate", 'pip install -e ".[test]"')
    deployment = yaml.safe_load((DEPLOY / "k8s" / "deployment.yaml").read_text())
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["pth"] = "/health"
    assert validate.validate_core(deployment)


def test_custom_resources_validate_against_their_crd_schemas():
    require_module("cloudcoil", 'pip install -e ".[test]"')
    custom = [(path, doc) for path, doc in OBJECTS if validate.is_custom(doc)]
    assert {doc["kind"] for _, doc in custom} == {"ScaledObject", "ServiceMonitor", "PrometheusRule"}
    problems = {f"{path.name}: {doc['kind']}": validate.validate_custom(doc) for path, doc in custom}
    assert problems == {k: [] for k in problems}


NOT_SERVE_FLAGS = {"--check", "--dry-run", "--validate", "--local", "--strict", "--previous", "--pid"}
"""Flags of the other tools the texts name: the generators' --check, kubectl's, kubernetes-validate's, py-spy's."""


def test_every_serve_flag_the_texts_name_exists():
    """The runbooks (alerts.yaml), the dashboard's descriptions, the manifests' comments and deploy/README.md tell
    operators which `pagedllm serve` flags to change: each must be one the server honours, spelt exactly (argparse
    would take the Deployment's `--drain-timeout` as an abbreviation of a renamed `--drain-timeout-s`)."""
    from pagedllm.config.arguments import VLLM_ONLY_PREFIX

    _, subparser = serve_parser()
    honoured = {s for action in subparser._actions if not action.dest.startswith(VLLM_ONLY_PREFIX)
                for s in action.option_strings}
    texts = [DEPLOY / "prometheus" / "alerts.yaml", DEPLOY / "grafana" / "pagedllm.json", DEPLOY / "README.md",
             *sorted((DEPLOY / "k8s").rglob("*.yaml"))]
    named = {flag for path in texts for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]+", path.read_text())}
    assert {"--max-num-seqs", "--kv-cache-memory", "--drain-timeout"} <= named
    assert named - NOT_SERVE_FLAGS - honoured == set()
