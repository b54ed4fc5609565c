"""The Kubernetes manifests (docker/k8s): every kustomization renders with ``kubectl
kustomize``, every object it renders validates against the Kubernetes API schemas
(PyPI ``kubernetes-validate``, strict: unknown fields are errors), and the essentials
docs/kubernetes.md promises are in the rendered output.

No cluster runs here: this is what CI can check. ``make system-deps`` makes sure a
kubectl with Kustomize v5 exists; without one this module fails (never skips).
"""

from __future__ import annotations

import copy
import json
import os
import posixpath
import re
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvbeam.proto.version import SERVICE_NAME

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "docker" / "k8s"
#: The schemas every object must pass: 1.27 is the oldest release with GA gRPC probes,
#: 1.32 the kubectl this project renders with. Pinned, with kubernetes-validate's own
#: version in pyproject's dev extra.
SCHEMA_VERSIONS = ("1.27.0", "1.32.0")
#: Components, replacements of list keys and `patches` with targets need Kustomize v5
#: (kubectl >= 1.27); Debian 12's kubectl 1.20 bundles Kustomize v2.0.3 (docs/kubernetes.md).
KUSTOMIZE_MIN = (5, 0)
#: Every kustomization under docker/k8s that deploys something (components are rendered
#: through an overlay below) and what its daemons must look like.
OVERLAYS = {
    "base": {"transport": "auto", "rdma": False, "host_network": False},
    "overlays/rdma": {"transport": "rdma", "rdma": True, "host_network": False},
    "overlays/softroce": {"transport": "rdma", "rdma": True, "host_network": True},
    "overlays/tcp": {"transport": "tcp", "rdma": False, "host_network": False},
}
SCHEDULER = "scheduler"
RDMA_RESOURCE = "rdma/hca_shared_devices_a"
#: role -> (control port, metrics port), as docs/kubernetes.md and the Job use them.
PORTS = {"prefill": (50051, 9400), "decode": (50052, 9401)}
AUTH_SECRET = "kvbeam-auth"
KVBEAM_GID = 10001

Obj = dict[str, Any]


@cache
def _kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail("kubectl is not installed: run `make system-deps` (docs/kubernetes.md)")
    out = subprocess.run([path, "version", "--client", "-o", "json"], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    bundled = json.loads(out).get("kustomizeVersion", "")  # absent before kubectl 1.21
    found = re.match(r"v(\d+)\.(\d+)", bundled)
    if found is None or (int(found.group(1)), int(found.group(2))) < KUSTOMIZE_MIN:
        pytest.fail(f"kubectl at {path} bundles Kustomize {bundled or '< v4'}; these manifests "
                    f"need v{KUSTOMIZE_MIN[0]}: see docs/kubernetes.md (make system-deps)")
    return path


@cache
def render(directory: Path) -> list[Obj]:
    """``kubectl kustomize DIRECTORY``, parsed; a failed build fails the test with its error."""
    run = subprocess.run([_kubectl(), "kustomize", str(directory)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, f"kubectl kustomize {directory}: {run.stderr}"
    return [doc for doc in yaml.safe_load_all(run.stdout) if doc]


def overlay_on(tmp_path: Path, kustomization: dict[str, Any]) -> list[Obj]:
    """Render a kustomization written to tmp_path; ``@/x`` entries name docker/k8s/x.

    Kustomize refuses absolute paths, so those become paths relative to tmp_path.
    """
    rel = os.path.relpath(K8S, tmp_path)

    def fix(value: Any) -> Any:
        if isinstance(value, str) and value.startswith("@/"):
            return posixpath.join(rel, value[2:])
        if isinstance(value, list):
            return [fix(v) for v in value]
        return value

    text = yaml.safe_dump({k: fix(v) for k, v in kustomization.items()})
    (tmp_path / "kustomization.yaml").write_text(text)
    return render(tmp_path)


def find(objs: list[Obj], kind: str, name: str) -> Obj:
    matches = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} rendered"
    return matches[0]


def container(deployment: Obj) -> Obj:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    c: Obj = containers[0]
    return c


def env(c: Obj) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def validation_errors(objs: list[Obj]) -> list[str]:
    errors = []
    for obj in objs:
        for version in SCHEMA_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                errors.append(f"{obj['kind']}/{obj['metadata']['name']} @ {version}: {e}")
    return errors


def test_every_kustomization_is_checked() -> None:
    found = set()
    for path in K8S.rglob("kustomization.yaml"):
        if yaml.safe_load(path.read_text()).get("kind") != "Component":
            found.add(path.parent.relative_to(K8S).as_posix())
    assert found == {*OVERLAYS, SCHEDULER}


@pytest.mark.parametrize("name", [*OVERLAYS, SCHEDULER])
def test_renders_and_validates(name: str) -> None:
    objs = render(K8S / name)
    assert objs, f"{name} rendered nothing"
    assert validation_errors(objs) == []
    # Secrets are created by the operator (docs/kubernetes.md), never generated from the tree.
    assert [o for o in objs if o["kind"] == "Secret"] == []


def test_the_validator_catches_a_broken_object() -> None:
    deployment = find(render(K8S / "overlays/rdma"), "Deployment", "kvbeam-prefill")
    named_port = copy.deepcopy(deployment)
    container(named_port)["readinessProbe"]["grpc"]["port"] = "grpc"  # gRPC probes: int only
    typo = copy.deepcopy(deployment)
    container(typo)["securityContext"]["capabilites"] = {"add": ["IPC_LOCK"]}
    for broken in (named_port, typo):
        assert len(validation_errors([broken])) == len(SCHEMA_VERSIONS)


@pytest.mark.parametrize("role", PORTS)
@pytest.mark.parametrize("name", OVERLAYS)
def test_daemon_essentials(name: str, role: str) -> None:
    control, metrics = PORTS[role]
    d = find(render(K8S / name), "Deployment", f"kvbeam-{role}")
    pod = d["spec"]["template"]
    c = container(d)
    variables = env(c)
    assert c["args"] == [role]
    assert variables["KVBEAM_LISTEN"] == f"0.0.0.0:{control}"
    assert variables["KVBEAM_CONFIG"] == f"/etc/kvbeam/{role}.yaml"
    # Peers dial the pod's own address; $(POD_IP) expands only if defined before it.
    names = [e["name"] for e in c["env"]]
    assert names.index("POD_IP") < names.index("KVBEAM_ADVERTISE")
    assert variables["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert variables["KVBEAM_ADVERTISE"] == f"$(POD_IP):{control}"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": control, "metrics": metrics}
    # Native gRPC probes on the control port, asking for the kvbeam service's health.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": control, "service": SERVICE_NAME}, probe
    # Memlock: the wrapper raises it (CAP_SYS_RESOURCE) before the image's entrypoint.
    assert c["command"][:4] == ["/usr/bin/tini", "--", "/bin/sh", "-c"]
    script = c["command"][4]
    assert "ulimit -l unlimited" in script
    assert 'exec /usr/local/bin/kvbeam-entrypoint "$@"' in script
    security = c["securityContext"]
    assert security["runAsUser"] == 0 and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert {"IPC_LOCK", "SYS_RESOURCE", "SETUID", "SETGID"} <= set(
        security["capabilities"]["add"])
    # The token: a file from the operator's Secret, readable by the kvbeam group.
    token = variables["KVBEAM_AUTH_TOKEN_FILE"]
    assert "KVBEAM_AUTH_TOKEN" not in variables and "KVBEAM_INSECURE" not in variables
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    auth = [n for n, v in volumes.items() if v.get("secret", {}).get("secretName") == AUTH_SECRET]
    assert len(auth) == 1
    items = volumes[auth[0]]["secret"]["items"]
    assert token == posixpath.join(mounts[auth[0]], items[0]["path"]) and items[0]["key"] == "token"
    assert volumes[auth[0]]["secret"]["defaultMode"] == 0o440  # owner and fsGroup only
    assert pod["spec"]["securityContext"]["fsGroup"] == KVBEAM_GID
    # Prometheus: the annotations point at the port the daemon serves metrics on.
    assert pod["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true", "prometheus.io/port": str(metrics),
        "prometheus.io/path": "/metrics"}
    assert variables["KVBEAM_METRICS"] == f"0.0.0.0:{metrics}"


@pytest.mark.parametrize("name", OVERLAYS)
def test_headless_services_select_the_daemons(name: str) -> None:
    objs = render(K8S / name)
    for role, (control, metrics) in PORTS.items():
        svc = find(objs, "Service", f"kvbeam-{role}")["spec"]
        assert svc["clusterIP"] == "None"
        labels = find(objs, "Deployment", f"kvbeam-{role}")["spec"]["template"]["metadata"][
            "labels"]
        assert svc["selector"].items() <= labels.items()
        assert svc["selector"]["app.kubernetes.io/component"] == role
        ports = {p["name"]: (p["port"], p["targetPort"]) for p in svc["ports"]}
        assert ports == {"grpc": (control, "grpc"), "metrics": (metrics, "metrics")}
    # No other Deployment matches a daemon Service's selector.
    selected = [o for o in objs if o["kind"] == "Deployment"
                and o["spec"]["template"]["metadata"]["labels"].get(
                    "app.kubernetes.io/component") in PORTS]
    assert len(selected) == len(PORTS)


@pytest.mark.parametrize("name", OVERLAYS)
def test_transport_per_overlay(name: str) -> None:
    want = OVERLAYS[name]
    for role in PORTS:
        d = find(render(K8S / name), "Deployment", f"kvbeam-{role}")
        c, spec = container(d), d["spec"]["template"]["spec"]
        assert env(c)["KVBEAM_TRANSPORT"] == want["transport"]
        limits = c["resources"].get("limits", {})
        assert (RDMA_RESOURCE in limits) is want["rdma"]
        if want["rdma"]:
            assert limits[RDMA_RESOURCE] == 1
        assert spec.get("hostNetwork", False) is want["host_network"]
        if want["host_network"]:
            assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"
            assert env(c)["KVBEAM_SOFTROCE"] == "eth0"
        else:
            assert "KVBEAM_SOFTROCE" not in env(c)


#: Where a daemon container's resources are, as a JSON pointer from its Deployment.
RESOURCES = "/spec/template/spec/containers/0/resources/"


def daemon_resources(tmp_path: Path, operations: list[dict[str, Any]]) -> dict[str, Obj]:
    """The rdma overlay with ``operations`` (a JSON patch) on every kvbeam Deployment, as
    docs/kubernetes.md's overlays write them: each daemon container's resources by role
    (the render validated)."""
    objs = overlay_on(tmp_path, {
        "resources": ["@/overlays/rdma"],
        "patches": [{"target": {"kind": "Deployment",
                                "labelSelector": "app.kubernetes.io/part-of=kvbeam"},
                     "patch": yaml.safe_dump(operations)}]})
    assert validation_errors(objs) == []
    return {role: container(find(objs, "Deployment", f"kvbeam-{role}"))["resources"]
            for role in PORTS}


def test_rdma_resource_name_is_configurable(tmp_path: Path) -> None:
    """docs/kubernetes.md's override: another device plugin's resource instead of the default."""
    limits = RESOURCES + "limits/"
    for resources in daemon_resources(tmp_path, [
            {"op": "remove", "path": limits + "rdma~1hca_shared_devices_a"},
            {"op": "add", "path": limits + "nvidia.com~1hostdev", "value": 1}]).values():
        assert "nvidia.com/hostdev" in resources["limits"]
        assert RDMA_RESOURCE not in resources["limits"]


def test_cpu_placement_patch_gives_guaranteed_qos(tmp_path: Path) -> None:
    """docs/kubernetes.md's CPU placement patch: every daemon's container asks what it is
    limited to, an integer CPU (what the static CPU manager gives exclusive cores)."""
    for role, resources in daemon_resources(tmp_path, [
            {"op": "add", "path": RESOURCES + "limits/cpu", "value": "1"},
            {"op": "replace", "path": RESOURCES + "requests/memory", "value": "2Gi"}]).items():
        for name in ("cpu", "memory"):
            assert resources["requests"][name] == resources["limits"][name], (role, name)
        assert str(resources["limits"]["cpu"]).isdigit(), role


def test_mtls_component(tmp_path: Path) -> None:
    objs = overlay_on(tmp_path, {"resources": ["@/overlays/rdma"],
                                 "components": ["@/components/mtls"]})
    assert validation_errors(objs) == []
    for role in PORTS:
        d = find(objs, "Deployment", f"kvbeam-{role}")
        c = container(d)
        variables = env(c)
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == "kvbeam-tls"
        for var, file in (("CERT", "tls.crt"), ("KEY", "tls.key"), ("CA", "ca.crt")):
            assert variables[f"KVBEAM_TLS_{var}"] == posixpath.join(mounts["tls"], file)
        assert variables["KVBEAM_TLS_SERVER_NAME"] == "kvbeam"
        assert "KVBEAM_AUTH_TOKEN_FILE" in variables  # the token stays on as well
        # Plaintext gRPC probes cannot pass mTLS: `kvbeam health` runs in the pod with its
        # own KVBEAM_TLS_* credentials, on the port the daemon listens on.
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert "grpc" not in c[probe] and "tcpSocket" not in c[probe]
            shell, flag, script = c[probe]["exec"]["command"]
            assert (shell, flag) == ("/bin/sh", "-c")
            assert "-m kvbeam.commands.health" in script
            assert script.endswith("127.0.0.1:${KVBEAM_LISTEN##*:}")
            assert variables["KVBEAM_LISTEN"].endswith(f":{PORTS[role][0]}")


def test_scheduler_job_finds_every_daemon_through_dns() -> None:
    job = find(render(K8S / SCHEDULER), "Job", "kvbeam-drive")
    pod = job["spec"]["template"]["spec"]
    c = container(job)
    args = c["args"]
    assert args[0] == "drive" and "--require-verified" in args
    for role, (control, _) in PORTS.items():
        assert args[args.index(f"--{role}") + 1] == f"dns:kvbeam-{role}:{control}"
        # The name is a headless Service of the daemons, on that port.
        find(render(K8S / "base"), "Service", f"kvbeam-{role}")
    assert pod["restartPolicy"] == "Never"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["fsGroup"] == KVBEAM_GID
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    secret = {v["name"]: v["secret"] for v in pod["volumes"]}["auth"]
    assert secret["secretName"] == AUTH_SECRET
    assert env(c)["KVBEAM_AUTH_TOKEN_FILE"] == posixpath.join(
        mounts["auth"], secret["items"][0]["path"])


FAKE_DAEMON = """#!/bin/sh
echo "args=$*"
echo "uid=$(id -u) gid=$(id -g)"
echo "memlock=$(ulimit -l)"
grep -E '^(CapEff|NoNewPrivs):' /proc/self/status | tr -d '\\t'
echo "token=$(cat "$KVBEAM_AUTH_TOKEN_FILE")"
"""


def _run_wrapper(role: str, caps: list[str], where: Path) -> subprocess.CompletedProcess[str]:
    """The rendered container command with only ``caps`` and no_new_privs (as the runtime
    starts it), through docker/entrypoint.sh, ending in a stand-in ``kvbeam`` that reports."""
    c = container(find(render(K8S / "overlays/rdma"), "Deployment", f"kvbeam-{role}"))
    # The command after tini (not needed here), the image's entrypoint path made the repo's.
    command = [arg.replace("/usr/local/bin/kvbeam-entrypoint", str(REPO / "docker/entrypoint.sh"))
               for arg in c["command"][2:]]
    bounding = ",".join(["-all"] + [f"+{cap.lower()}" for cap in caps])
    environment = {"PATH": f"{where}:/usr/sbin:/usr/bin:/sbin:/bin", "KVBEAM_RUN_AS": "daemon",
                   "KVBEAM_TRANSPORT": "tcp", "KVBEAM_AUTH_TOKEN_FILE": str(where / "token")}
    # The runtime's default: a low soft memlock limit under the hard one.
    return subprocess.run(
        ["prlimit", "--memlock=65536:", "setpriv", f"--bounding-set={bounding}",
         "--inh-caps=-all", "--no-new-privs", "--", *command, *c["args"]],
        env=environment, capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(os.geteuid() != 0, reason="setpriv with a reduced capability set: root")
@pytest.mark.parametrize("role", PORTS)
def test_container_command_drops_privileges_and_reads_the_token(role: str) -> None:
    """The daemons' command, with exactly the manifests' capabilities, on this host.

    ``daemon`` (uid and gid 1, a name that is also its group's) plays the image's kvbeam
    user and gid 1 the pod's fsGroup. This host's hard memlock limit is whatever the
    sandbox allows (raising it needs CAP_SYS_RESOURCE in the host's own set): the soft
    limit must reach it.
    """
    where = Path(tempfile.mkdtemp(prefix="kvbeam-k8s-"))
    try:
        where.chmod(0o755)  # the dropped user runs the stand-in and reads the token here
        (where / "kvbeam").write_text(FAKE_DAEMON)
        (where / "kvbeam").chmod(0o755)
        (where / "token").write_text("not-a-secret\n")
        os.chown(where / "token", 0, 1)
        (where / "token").chmod(0o440)
        caps = container(find(render(K8S / "overlays/rdma"), "Deployment", f"kvbeam-{role}"))[
            "securityContext"]["capabilities"]["add"]
        run = _run_wrapper(role, caps, where)
        assert run.returncode == 0, run.stderr
        hard = subprocess.run(["/bin/sh", "-c", "ulimit -H -l"], capture_output=True,
                              text=True, check=True).stdout.strip()
        assert run.stdout.splitlines() == [
            f"args={role}", "uid=1 gid=1", f"memlock={hard}", "CapEff:0000000000000000",
            "NoNewPrivs:1", "token=not-a-secret"], run.stderr
        # Without SETUID/SETGID the drop fails and the container exits: they are needed.
        denied = _run_wrapper(role, [c for c in caps if not c.startswith("SET")], where)
        assert denied.returncode != 0 and "setpriv" in denied.stderr
    finally:
        shutil.rmtree(where)
