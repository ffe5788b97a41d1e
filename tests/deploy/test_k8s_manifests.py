"""deploy/k8s: every manifest validates offline against the schemas of Kubernetes 1.32 (kubernetes-validate,
strict: unknown fields are errors), and the manifests agree with each other and with the CLI they run."""
from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from lightning_persia import cli
from lightning_persia.remote_ps.config import load_ps_config
from lightning_persia.remote_ps.protocol import SERVICE_NAME, TOKEN_ENV

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
KUBERNETES_VERSION = "1.32.0"
TOKEN_SECRET = {"name": "persia-ps-token", "key": "token"}


def _documents() -> list[tuple[str, dict]]:
    return [(path.name, doc) for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


DOCS = _documents()


def _find(kind: str, name: str) -> dict:
    found = [doc for _, doc in DOCS if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _container(workload: dict) -> dict:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def _env(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_the_manifests_exist():
    assert {p.name for p in MANIFESTS} == {"checkpoints-pvc.yaml", "ps.yaml", "trainer.yaml", "serving.yaml"}


@pytest.mark.parametrize("name,doc", DOCS, ids=[f"{n}:{d['kind']}/{d['metadata']['name']}" for n, d in DOCS])
def test_each_manifest_validates_against_the_kubernetes_schemas(name, doc):
    assert kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True) == "1.32"


def test_the_validation_can_fail():
    broken = copy.deepcopy(_find("StatefulSet", "persia-ps"))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpcc"] = {"port": 5000}
    with pytest.raises(kubernetes_validate.ValidationError, match="grpcc"):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def _shard_addresses(statefulset: str) -> tuple[list[str], dict]:
    """The DNS names the pods of a shard StatefulSet get through its headless Service, in shard order."""
    sts = _find("StatefulSet", statefulset)
    service = _find("Service", sts["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"] == sts["spec"]["template"]["metadata"]["labels"]
    port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    return [f"{statefulset}-{i}.{service['metadata']['name']}:{port}" for i in range(sts["spec"]["replicas"])], sts


@pytest.mark.parametrize("statefulset", ["persia-ps", "persia-inference-ps"])
def test_shard_pods_know_their_index_and_count_carry_the_token_and_probe_grpc_health(statefulset):
    addresses, sts = _shard_addresses(statefulset)
    container = _container(sts)
    args = container["args"]
    assert args[:2] == ["ps", "serve"] and container["command"] == ["lightning-persia"]
    assert args[args.index("--num-shards") + 1] == str(len(addresses))
    assert args[args.index("--shard-index") + 1] == "$(SHARD_INDEX)"
    env = _env(container)
    assert env["SHARD_INDEX"] == {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}
    assert env[TOKEN_ENV] == {"secretKeyRef": TOKEN_SECRET}
    assert env["LD_PRELOAD"] == "libjemalloc.so.2" and "libjemalloc2" in (ROOT / "deploy" / "Dockerfile").read_text()
    grpc_port = int(args[args.index("--port") + 1])
    assert {"name": "grpc", "containerPort": grpc_port} in container["ports"]
    assert container["readinessProbe"]["grpc"] == {"port": grpc_port, "service": SERVICE_NAME}
    assert container["livenessProbe"]["grpc"]["port"] == grpc_port
    metrics_port = int(args[args.index("--metrics-port") + 1])
    assert {"name": "metrics", "containerPort": metrics_port} in container["ports"]


def test_the_training_shards_command_line_is_one_ps_serve_accepts():
    container = _container(_find("StatefulSet", "persia-ps"))
    args = [a.replace("$(SHARD_INDEX)", "3") for a in container["args"][2:]]
    parsed = cli._ps_parser().parse_args(["serve", *args])
    assert (parsed.shard_index, parsed.num_shards, parsed.host, parsed.metrics_port) == (3, 4, "0.0.0.0", 9100)
    config = load_ps_config(None, parsed.overrides)
    mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "checkpoints")
    assert config.checkpoint_root == mount


def _trainer_overlay() -> dict:
    return yaml.safe_load(_find("ConfigMap", "persia-trainer-config")["data"]["cluster.yaml"])


def test_the_trainers_name_every_shard_in_order_and_rendezvous_on_node_0():
    addresses, _ = _shard_addresses("persia-ps")
    overlay = _trainer_overlay()
    assert overlay["trainer"]["strategy"]["init_args"]["ps"]["addresses"] == addresses
    job = _find("Job", "persia-trainer")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    nodes = overlay["trainer"]["num_nodes"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == nodes
    container = _container(job)
    args = container["args"]
    assert container["command"] == ["torchrun"] and args[args.index("--nnodes") + 1] == str(nodes)
    assert args[args.index("--nproc-per-node") + 1] == str(overlay["trainer"]["devices"])
    assert args[args.index("--node-rank") + 1] == "$(NODE_RANK)"
    env = _env(container)
    assert env["NODE_RANK"] == {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    assert env[TOKEN_ENV] == {"secretKeyRef": TOKEN_SECRET}
    service = _find("Service", pod["subdomain"])
    assert args[args.index("--master-addr") + 1] == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert args[args.index("--master-port") + 1] == str(service["spec"]["ports"][0]["port"])
    assert args[args.index("--no-python") + 1:][:2] == ["lightning-persia", "fit"]


def test_the_trainer_config_is_one_lightning_cli_accepts(tmp_path):
    overlay = tmp_path / "cluster.yaml"
    overlay.write_text(_find("ConfigMap", "persia-trainer-config")["data"]["cluster.yaml"])
    done = subprocess.run([sys.executable, "-m", "lightning_persia.cli", "fit", "--config", "examples/dlrm/config.yaml",
                           "--config", str(overlay), "--print_config"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = yaml.safe_load(done.stdout)
    assert printed["trainer"]["num_nodes"] == 2
    strategy = printed["trainer"]["strategy"]["init_args"]
    assert strategy["metrics"] == {"port": 9400, "host": "0.0.0.0"}
    assert (strategy["ps"]["addresses"][0], strategy["ps"]["timeout_s"]) == ("persia-ps-0.persia-ps:5000", 120)


def test_serving_reads_the_inference_shards_and_is_ready_on_health():
    addresses, _ = _shard_addresses("persia-inference-ps")
    container = _container(_find("Deployment", "persia-serving"))
    args = container["args"]
    assert args[:2] == ["serve", "/bundle"]
    assert args[args.index("--ps-addresses") + 1:] == addresses
    port = int(args[args.index("--port") + 1])
    assert {"name": "http", "containerPort": port} in container["ports"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert _env(container)[TOKEN_ENV] == {"secretKeyRef": TOKEN_SECRET}
    shard = _container(_find("StatefulSet", "persia-inference-ps"))
    assert shard["args"][shard["args"].index("--restore-from") + 1] == "/bundle" and "--read-only" in shard["args"]
    assert [m["subPath"] for m in (shard["volumeMounts"][0], container["volumeMounts"][0])] == ["bundles/dlrm"] * 2
