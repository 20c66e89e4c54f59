#!/usr/bin/python3
"""Runs the rendered cpu overlay as local processes: the coordinator's and
the workers' container command and args exactly as rendered, then the train
Job's shardctl command, on loopback. Only what Kubernetes itself would
provide is substituted: $(VAR) from the container's env and the downward API
(pod name, namespace, pod IP -> 127.0.0.1), mounted volumes -> temp dirs
holding the Secret items (deploy/k8s/make-secrets.sh --print, test certs
from tools/make_test_certs.sh) and the ConfigMap, each pod's ports -> free
loopback ports (every pod has its own network namespace), Service and pod
DNS names -> 127.0.0.1 and the selected pod's port. The kubelet's probes are
played too: a plaintext grpc.health.v1 Check on each probe's port must say
SERVING (workers only after registering). The Job trains a few steps
(--steps lowered, --json added) and must report a finite loss for each.
Then Prometheus is played: every pod annotated prometheus.io/scrape is
scraped on its annotated port and path, which must be a named "metrics"
container port that a NetworkPolicy opens to Prometheus pods, and the
scraped step counters must equal the steps trained.

A wrong flag, path, port, key or probe in a manifest fails this test.
Every process is stopped (SIGTERM, then SIGKILL) and every wait is bounded.
"""

import base64
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import unittest
import urllib.request

import grpc
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import k8s_util  # noqa: E402

NAMESPACE = "default"
TRAIN_STEPS = 3
BINARIES = {
    "shardd-coordinator": "server/shardd-coordinator",
    "shardd-worker": "worker/shardd-worker",
    "shardctl": "client/shardctl",
}
SERVING = 1


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health_status(port):
    """grpc.health.v1.Health/Check for the overall status, plaintext, as
    the kubelet's gRPC probe sends it; the status number, or None when the
    call fails. The messages are tiny enough to encode by hand: an empty
    request, and a response whose field 1 (varint) is the status."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        try:
            response = check(b"", timeout=1)
        except grpc.RpcError:
            return None
    if response == b"":
        return 0
    if len(response) == 2 and response[0] == 0x08:
        return response[1]
    raise AssertionError(f"unexpected health response {response!r}")


def expand(text, env):
    """Kubernetes' $(VAR) expansion in command and args ($$ escapes)."""
    def replace(m):
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", replace, text)


class Pod:
    """One pod of a rendered workload, materialized on this machine."""

    def __init__(self, name, spec, metadata, root):
        self.name = name
        self.spec = spec
        self.labels = metadata["labels"]
        self.annotations = metadata.get("annotations", {})
        self.container = spec["containers"][0]
        # Container port -> the loopback port standing in for it.
        self.ports = {p["containerPort"]: free_port()
                      for p in self.container.get("ports", [])}
        self.dir = os.path.join(root, name)
        os.makedirs(self.dir)
        self.mounts = {}  # mountPath -> directory here
        self.process = None
        self.log = os.path.join(self.dir, "stderr.log")

    def env(self):
        values = {}
        for e in self.container.get("env", []):
            if "value" in e:
                values[e["name"]] = expand(e["value"], values)
                continue
            field = e["valueFrom"]["fieldRef"]["fieldPath"]
            values[e["name"]] = {
                "metadata.name": self.name,
                "metadata.namespace": NAMESPACE,
                "status.podIP": "127.0.0.1",
            }[field]
        return values

    def port_for(self, name_or_number):
        if isinstance(name_or_number, int):
            return self.ports[name_or_number]
        for p in self.container["ports"]:
            if p["name"] == name_or_number:
                return self.ports[p["containerPort"]]
        raise KeyError(f"{self.name}: no port {name_or_number}")


class SmokeTest(unittest.TestCase):

    def setUp(self):
        self.root = k8s_util.make_temp_dir("smoke")
        self.home = os.path.join(self.root, "home")
        os.makedirs(self.home)
        self.pods = []
        kubectls = k8s_util.kubectls()
        self.assertTrue(kubectls, "no kubectl")
        tree = k8s_util.copy_tree(os.path.join(self.root, "k8s"))
        self.objects, _ = k8s_util.render(kubectls[0], tree, "overlays/cpu",
                                          self.home)
        train, _ = k8s_util.render(kubectls[0], tree, "train", self.home)
        self.job = k8s_util.one(train, "Job", "shardd-train")
        result = subprocess.run(
            ["deploy/k8s/make-secrets.sh", "--print", NAMESPACE,
             os.path.join(self.root, "certs")],
            capture_output=True, text=True, timeout=120,
            env=dict(k8s_util.kubectl_env(self.home), KUBECTL=kubectls[0]))
        self.assertEqual(result.returncode, 0, result.stderr)
        self.secrets = {s["metadata"]["name"]: s
                        for s in yaml.safe_load_all(result.stdout) if s}
        # The image has the binaries on PATH under these names.
        self.bin = os.path.join(self.root, "bin")
        os.makedirs(self.bin)
        for name, path in BINARIES.items():
            os.symlink(os.path.abspath(path), os.path.join(self.bin, name))

    def tearDown(self):
        # Workers and clients first, the coordinator last.
        for pod in reversed(self.pods):
            if pod.process and pod.process.poll() is None:
                pod.process.send_signal(signal.SIGTERM)
        for pod in reversed(self.pods):
            if pod.process is None:
                continue
            try:
                pod.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pod.process.kill()
                pod.process.wait(timeout=10)

    def logs(self):
        text = []
        for pod in self.pods:
            if os.path.exists(pod.log):
                with open(pod.log, errors="replace") as f:
                    tail = f.read()[-3000:]
                text.append(f"---- {pod.name} ----\n{tail}")
        return "\n".join(text)

    # -- materializing pods ------------------------------------------------

    def mount_volumes(self, pod):
        volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
        config_maps = {o["metadata"]["name"]: o for o in self.objects
                       if o["kind"] == "ConfigMap"}
        for m in pod.container.get("volumeMounts", []):
            v = volumes[m["name"]]
            where = os.path.join(pod.dir, "volumes", m["name"])
            os.makedirs(where)
            if "secret" in v:
                secret = self.secrets[v["secret"]["secretName"]]
                for item in v["secret"]["items"]:
                    with open(os.path.join(where, item["path"]), "wb") as f:
                        f.write(base64.b64decode(secret["data"][item["key"]]))
            elif "configMap" in v:
                cm = config_maps[v["configMap"]["name"]]
                for key, value in cm["data"].items():
                    with open(os.path.join(where, key), "w") as f:
                        f.write(value)
            elif "emptyDir" in v or "persistentVolumeClaim" in v:
                pass  # an empty directory
            else:
                self.fail(f"{pod.name}: volume kind not handled: {v}")
            if m["mountPath"] == "/dev/shm":
                continue  # this machine has one; no argument names it
            pod.mounts[m["mountPath"]] = where

    def resolve(self, host, port, pod):
        """host:port as seen from `pod` -> the loopback address standing in
        for it, or None when it names nothing of ours."""
        if host == "0.0.0.0":
            return f"127.0.0.1:{pod.port_for(int(port))}"
        labels = host.split(".")
        suffixes = ([], [NAMESPACE], [NAMESPACE, "svc"],
                    [NAMESPACE, "svc", "cluster", "local"])
        for service in k8s_util.by_kind(self.objects, "Service"):
            name = service["metadata"]["name"]
            for suffix in suffixes:
                if labels == [name] + suffix:
                    target = self.select(service)
                elif (len(labels) == len(suffix) + 2 and labels[1] == name and
                      labels[2:] == suffix and
                      service["spec"].get("clusterIP") == "None"):
                    target = [p for p in self.select(service)
                              if p.name == labels[0]]
                else:
                    continue
                self.assertTrue(target, f"{host}: no pod behind it")
                ports = [p for p in service["spec"]["ports"]
                         if p["port"] == int(port)]
                self.assertEqual(len(ports), 1,
                                 f"{host}:{port}: not a port of {name}")
                target_port = ports[0].get("targetPort", int(port))
                return f"127.0.0.1:{target[0].port_for(target_port)}"
        return None

    def select(self, service):
        selector = service["spec"]["selector"]
        return [p for p in self.pods
                if all(p.labels.get(k) == v for k, v in selector.items())]

    def command_line(self, pod, overrides=None):
        env = pod.env()
        argv = [expand(a, env) for a in
                pod.container.get("command", []) + pod.container.get("args",
                                                                     [])]
        if overrides:
            argv = overrides(argv)
        out = []
        for arg in argv:
            # Mounted paths -> the directories standing in for them.
            for path in sorted(pod.mounts, key=len, reverse=True):
                arg = re.sub(re.escape(path) + r"(?=/|$)", pod.mounts[path],
                             arg)
            # DNS names and wildcard listen addresses -> loopback.
            def replace(m):
                found = self.resolve(m.group(1), m.group(2), pod)
                return found if found else m.group(0)
            arg = re.sub(r"(?<![\w.-])([a-z0-9][a-z0-9.-]*):(\d+)\b", replace,
                         arg)
            out.append(arg)
        self.assertIn(os.path.basename(out[0]),
                      list(BINARIES) + ["sh"],
                      f"{pod.name}: the image has no {out[0]}")
        return out, env

    def start(self, pod, overrides=None, capture=False):
        """Starts the pod's process; its stdout is a pipe with `capture`,
        else a file."""
        argv, env = self.command_line(pod, overrides)
        process_env = {"PATH": f"{self.bin}:/usr/bin:/bin",
                       "HOME": pod.dir, **env}
        with open(pod.log, "w") as log, \
                open(os.path.join(pod.dir, "stdout.log"), "w") as out:
            pod.process = subprocess.Popen(
                argv, env=process_env,
                stdout=subprocess.PIPE if capture else out, stderr=log,
                stdin=subprocess.DEVNULL, cwd=pod.dir)
        return argv

    def wait_ready(self, pod, timeout):
        """Plays the readiness probe until SERVING (bounded)."""
        probe = pod.container["readinessProbe"]["grpc"]
        port = pod.port_for(probe["port"])
        deadline = time.monotonic() + timeout
        status = None
        while time.monotonic() < deadline:
            self.assertIsNone(pod.process.poll(),
                              f"{pod.name} exited\n{self.logs()}")
            status = health_status(port)
            if status == SERVING:
                break
            time.sleep(0.2)
        self.assertEqual(status, SERVING,
                         f"{pod.name} not ready in {timeout}s (readiness "
                         f"probe port {probe['port']})\n{self.logs()}")
        # The liveness probe asks the same service, on a port that may be
        # another server's: the worker flips the two one after the other,
        # so allow it a moment (bounded).
        live = pod.container["livenessProbe"]["grpc"]["port"]
        live_deadline = time.monotonic() + 5
        while (health_status(pod.port_for(live)) != SERVING and
               time.monotonic() < live_deadline):
            time.sleep(0.05)
        self.assertEqual(health_status(pod.port_for(live)), SERVING)

    def pods_of(self, owner, count):
        template = owner["spec"]["template"]
        pods = []
        for i in range(count):
            name = (f"{owner['metadata']['name']}-{i}"
                    if owner["kind"] == "StatefulSet"
                    else f"{owner['metadata']['name']}-7d9f8-x2x4q")
            pod = Pod(name, template["spec"], template["metadata"],
                      self.root)
            self.mount_volumes(pod)
            pods.append(pod)
        return pods

    # -- playing Prometheus --------------------------------------------------

    def scrape(self, pod):
        """GETs the pod's annotated metrics endpoint; {(name, labels):
        value} of its samples (labels as a sorted tuple of pairs)."""
        port = int(pod.annotations["prometheus.io/port"])
        path = pod.annotations.get("prometheus.io/path", "/metrics")
        named = [p for p in pod.container["ports"]
                 if p["containerPort"] == port]
        self.assertEqual([p.get("name") for p in named], ["metrics"],
                         f"{pod.name}: prometheus.io/port {port} is not the "
                         f"container port named metrics")
        self.assertTrue(self.admits_prometheus(pod, port),
                        f"{pod.name}: no NetworkPolicy admits Prometheus "
                        f"pods to port {port}")
        url = f"http://127.0.0.1:{pod.port_for(port)}{path}"
        # Straight to loopback, whatever proxy the environment names.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(url, timeout=5) as response:
            self.assertEqual(response.status, 200)
            text = response.read().decode()
        samples = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            m = re.fullmatch(r"([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)", line)
            self.assertIsNotNone(m, f"{pod.name}: bad sample line {line!r}")
            labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"',
                                             m.group(2) or "")))
            samples[(m.group(1), labels)] = float(m.group(3))
        return samples

    def admits_prometheus(self, pod, port):
        prometheus = {"app.kubernetes.io/name": "prometheus"}
        for policy in k8s_util.by_kind(self.objects, "NetworkPolicy"):
            selector = policy["spec"]["podSelector"].get("matchLabels", {})
            if any(pod.labels.get(k) != v for k, v in selector.items()):
                continue
            for rule in policy["spec"].get("ingress", []):
                ports = [p.get("port") for p in rule.get("ports", [])]
                if ports and port not in ports:
                    continue
                for peer in rule.get("from", []):
                    labels = peer.get("podSelector", {}).get("matchLabels",
                                                             {})
                    if (labels and "namespaceSelector" in peer and
                            all(prometheus.get(k) == v
                                for k, v in labels.items())):
                        return True
        return False

    # -- the test ----------------------------------------------------------

    def test_cpu_overlay_trains(self):
        deployment = k8s_util.one(self.objects, "Deployment",
                                  "shardd-coordinator")
        stateful_set = k8s_util.one(self.objects, "StatefulSet",
                                    "shardd-worker")
        [coordinator] = self.pods_of(deployment, 1)
        workers = self.pods_of(stateful_set, stateful_set["spec"]["replicas"])
        [client] = self.pods_of(self.job, 1)
        # Every pod exists before any starts, so DNS names resolve (the
        # headless Service publishes not-ready pods).
        self.pods = [coordinator] + workers + [client]

        self.start(coordinator)
        self.wait_ready(coordinator, 30)
        for worker in workers:
            self.start(worker)
        for worker in workers:
            self.wait_ready(worker, 60)

        def fewer_steps(argv):
            steps = [a for a in argv if a.startswith("--steps=")]
            self.assertEqual(len(steps), 1, argv)
            return [f"--steps={TRAIN_STEPS}" if a in steps else a
                    for a in argv] + ["--json"]

        argv = self.start(client, fewer_steps, capture=True)
        try:
            out, _ = client.process.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            client.process.kill()
            client.process.communicate()
            self.fail(f"shardctl train did not finish\n{self.logs()}")
        self.assertEqual(client.process.returncode, 0,
                         f"{argv}\n{out.decode()}\n{self.logs()}")
        # `shardctl train --json`: a line per step, the summary last.
        report = json.loads(out.decode().strip().splitlines()[-1])
        losses = report["losses"]
        self.assertEqual(len(losses), TRAIN_STEPS, report)
        for loss in losses:
            self.assertTrue(math.isfinite(loss) and loss > 0, losses)
        print(f"{len(workers)} workers trained {TRAIN_STEPS} steps; "
              f"losses {losses}")

        # Prometheus' view: every pod that asks to be scraped is, and
        # counts the steps trained.
        scraped = [p for p in self.pods
                   if p.annotations.get("prometheus.io/scrape") == "true"]
        self.assertEqual(sorted(p.name for p in scraped),
                         sorted(p.name for p in [coordinator] + workers))
        for worker in workers:
            samples = self.scrape(worker)
            self.assertEqual(samples.get(("shardd_worker_steps_total", ())),
                             TRAIN_STEPS, f"{worker.name}: {samples}")
        samples = self.scrape(coordinator)
        done = [v for (name, labels), v in samples.items()
                if name == "shardd_coordinator_job_steps_done"]
        self.assertEqual(done, [TRAIN_STEPS], samples)
        self.assertEqual(
            samples.get(("shardd_coordinator_workers",
                         (("state", "alive"),))), len(workers), samples)
        print(f"scraped {len(scraped)} metrics endpoints")
        print("client command line: " + " ".join(argv))


if __name__ == "__main__":
    unittest.main(verbosity=2)
