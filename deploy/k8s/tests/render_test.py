"""Renders every kustomization under deploy/k8s with every kubectl found
(kubectl on PATH, plus SHARDD_KUBECTLS), validates each object against the
Kubernetes JSON schemas of named Kubernetes versions (schema_check.py,
kubernetes-validate from the tests' Python environment) and checks what the manifests promise: probes on the health ports, GPUs only
in the gpu overlay, secrets and ConfigMap keys that exist, labels that the
Services and NetworkPolicies select. Different kubectls must render the
same objects."""

import base64
import copy
import json
import os
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import k8s_util  # noqa: E402
import schema_check  # noqa: E402


def container(pod_owner, name):
    for c in pod_owner["spec"]["template"]["spec"]["containers"]:
        if c["name"] == name:
            return c
    raise AssertionError(f"no container {name}")


def flag(args, name):
    """The value of --name=VALUE in args (None when absent)."""
    for arg in args:
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
    return None


def env_value(c, name):
    for e in c.get("env", []):
        if e["name"] == name:
            return e.get("value")
    return None


class RenderTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.home = k8s_util.make_temp_dir("home")
        cls.tree = k8s_util.copy_tree(
            os.path.join(k8s_util.make_temp_dir("tree"), "k8s"))
        cls.kubectls = k8s_util.kubectls()
        print("rendering with: " + ", ".join(cls.kubectls))
        # {(kubectl, kustomization): objects}
        cls.rendered = {}
        cls.errors = []
        for kubectl in cls.kubectls:
            for kustomization in k8s_util.KUSTOMIZATIONS:
                try:
                    objects, _ = k8s_util.render(kubectl, cls.tree,
                                                 kustomization, cls.home)
                    cls.rendered[(kubectl, kustomization)] = objects
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    cls.errors.append(str(e))
        # The Secrets deploy/k8s/make-secrets.sh makes, keyed by name.
        kubectl = cls.kubectls[0] if cls.kubectls else "kubectl"
        result = subprocess.run(
            ["deploy/k8s/make-secrets.sh", "--print", "default",
             os.path.join(k8s_util.make_temp_dir("certs"), "certs")],
            capture_output=True, text=True, timeout=120,
            env=dict(k8s_util.kubectl_env(cls.home), KUBECTL=kubectl))
        cls.secrets_error = result.stderr if result.returncode else None
        cls.secrets = {}
        if not result.returncode:
            import yaml
            for s in yaml.safe_load_all(result.stdout):
                if s:
                    cls.secrets[s["metadata"]["name"]] = s

    def test_found_a_kubectl(self):
        self.assertTrue(self.kubectls, "no kubectl on PATH or SHARDD_KUBECTLS")

    def test_every_kustomization_renders(self):
        self.assertEqual(self.errors, [])
        self.assertEqual(len(self.rendered),
                         len(self.kubectls) * len(k8s_util.KUSTOMIZATIONS))

    def test_objects_match_the_schemas(self):
        self.assertTrue(self.rendered)
        failures, checked = [], 0
        for (kubectl, kustomization), objects in self.rendered.items():
            for version in schema_check.KUBERNETES_VERSIONS:
                for obj in objects:
                    checked += 1
                    failures += [f"{kustomization} ({kubectl}), Kubernetes "
                                 f"{version}: {p}"
                                 for p in schema_check.problems(obj, version)]
        print(f"{checked} object checks against Kubernetes "
              f"{' and '.join(schema_check.KUBERNETES_VERSIONS)}")
        self.assertEqual(failures, [])

    def test_broken_objects_fail_the_schemas(self):
        """The check above can fail: a misspelt field, a wrong type, a
        missing required field and an unknown kind, each in an otherwise
        valid rendered object."""
        objects = self.rendered[(self.kubectls[0], "overlays/cpu")]
        workers = k8s_util.one(objects, "StatefulSet", "shardd-worker")

        def broken(change):
            obj = copy.deepcopy(workers)
            change(obj)
            return obj

        def misspelt(o):
            c = o["spec"]["template"]["spec"]["containers"][0]
            c["readinesProbe"] = c.pop("readinessProbe")

        def wrong_type(o):
            o["spec"]["replicas"] = "four"

        def no_selector(o):
            del o["spec"]["selector"]

        def unknown_kind(o):
            o["kind"] = "StatefulSett"
        for version in schema_check.KUBERNETES_VERSIONS:
            self.assertEqual(schema_check.problems(workers, version), [])
            for change, want in ((misspelt, "'readinesProbe' was unexpected"),
                                 (wrong_type, "/spec/replicas"),
                                 (no_selector, "'selector' is a required"),
                                 (unknown_kind, "no schema for apps/v1")):
                found = schema_check.problems(broken(change), version)
                self.assertTrue(any(want in p for p in found),
                                f"{change.__name__} under {version}: {found}")

    def test_kubectls_agree(self):
        def sort_env(value):
            # Strategic merge puts a patched env entry first (v2.0.3) or in
            # place (v5); none of ours refers to another, so order is moot.
            if isinstance(value, dict):
                return {k: (sorted((sort_env(e) for e in v),
                                   key=lambda e: e["name"])
                            if k == "env" else sort_env(v))
                        for k, v in value.items()}
            if isinstance(value, list):
                return [sort_env(v) for v in value]
            return value

        def canonical(objects):
            return sorted(json.dumps(sort_env(o), sort_keys=True)
                          for o in objects)
        for kustomization in k8s_util.KUSTOMIZATIONS:
            renders = [canonical(self.rendered[(k, kustomization)])
                       for k in self.kubectls
                       if (k, kustomization) in self.rendered]
            for other in renders[1:]:
                self.assertEqual(renders[0], other, kustomization)

    def overlays(self):
        for (kubectl, kustomization), objects in self.rendered.items():
            if kustomization.startswith("overlays/"):
                yield kustomization, objects

    def test_coordinator(self):
        for overlay, objects in self.overlays():
            with self.subTest(overlay=overlay):
                d = k8s_util.one(objects, "Deployment", "shardd-coordinator")
                self.assertEqual(d["spec"]["replicas"], 1)
                self.assertEqual(d["spec"]["strategy"]["type"], "Recreate")
                c = container(d, "coordinator")
                data_dir = flag(c["args"], "data-dir")
                volumes = {v["name"]: v for v in
                           d["spec"]["template"]["spec"]["volumes"]}
                mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
                self.assertIn(data_dir, mounts)
                claim = volumes[mounts[data_dir]]["persistentVolumeClaim"]
                k8s_util.one(objects, "PersistentVolumeClaim",
                             claim["claimName"])
                workers = k8s_util.one(objects, "StatefulSet", "shardd-worker")
                self.assertEqual(int(flag(c["args"], "workers")),
                                 workers["spec"]["replicas"])

    def test_probes_use_the_health_port(self):
        for overlay, objects in self.overlays():
            for kind, name, cname in (
                    ("Deployment", "shardd-coordinator", "coordinator"),
                    ("StatefulSet", "shardd-worker", "worker")):
                with self.subTest(overlay=overlay, kind=kind):
                    c = container(k8s_util.one(objects, kind, name), cname)
                    health = flag(c["args"], "health-listen")
                    self.assertIsNotNone(health)
                    port = int(health.rsplit(":", 1)[1])
                    self.assertIn(port, [p["containerPort"]
                                         for p in c["ports"]])
                    for probe in ("readinessProbe", "livenessProbe"):
                        self.assertEqual(c[probe]["grpc"]["port"], port)

    def test_gpus_only_in_the_gpu_overlay(self):
        for overlay, objects in self.overlays():
            with self.subTest(overlay=overlay):
                s = k8s_util.one(objects, "StatefulSet", "shardd-worker")
                c = container(s, "worker")
                self.assertIn("--device=$(SHARDD_DEVICE)", c["args"])
                limits = c["resources"]["limits"]
                if overlay == "overlays/gpu":
                    self.assertEqual(int(limits["nvidia.com/gpu"]), 1)
                    self.assertEqual(env_value(c, "SHARDD_DEVICE"), "cuda:0")
                    self.assertTrue(c["image"].endswith(":cuda"), c["image"])
                else:
                    self.assertNotIn("nvidia.com/gpu", limits)
                    self.assertNotIn("nvidia.com/gpu",
                                     c["resources"].get("requests", {}))
                    self.assertEqual(env_value(c, "SHARDD_DEVICE"), "cpu")
                    self.assertFalse(c["image"].endswith(":cuda"), c["image"])
                shm = [m for m in c["volumeMounts"]
                       if m["mountPath"] == "/dev/shm"]
                self.assertEqual(len(shm), 1)
                volume = [v for v in s["spec"]["template"]["spec"]["volumes"]
                          if v["name"] == shm[0]["name"]][0]
                self.assertEqual(volume["emptyDir"]["medium"], "Memory")

    def test_every_container_has_requests_and_limits(self):
        for (kubectl, kustomization), objects in self.rendered.items():
            for o in objects:
                if "template" not in o.get("spec", {}):
                    continue
                for c in o["spec"]["template"]["spec"]["containers"]:
                    with self.subTest(kustomization=kustomization,
                                      container=c["name"]):
                        for what in ("requests", "limits"):
                            self.assertIn("cpu", c["resources"][what])
                            self.assertIn("memory", c["resources"][what])

    def test_services_and_policies_select_the_pods(self):
        for overlay, objects in self.overlays():
            pods = {o["metadata"]["name"]:
                    o["spec"]["template"]["metadata"]["labels"]
                    for o in objects if o["kind"] in
                    ("Deployment", "StatefulSet")}
            train = k8s_util.one(self.rendered[(self.kubectls[0], "train")],
                                 "Job", "shardd-train")
            client_labels = train["spec"]["template"]["metadata"]["labels"]

            def selects(selector, labels):
                if any(labels.get(k) != v for k, v in
                       selector.get("matchLabels", {}).items()):
                    return False
                for e in selector.get("matchExpressions", []):
                    assert e["operator"] == "In", e
                    if labels.get(e["key"]) not in e["values"]:
                        return False
                return True

            with self.subTest(overlay=overlay):
                for svc, pod in (("shardd-coordinator", "shardd-coordinator"),
                                 ("shardd-worker", "shardd-worker")):
                    s = k8s_util.one(objects, "Service", svc)
                    self.assertTrue(selects({"matchLabels":
                                             s["spec"]["selector"]},
                                            pods[pod]))
                headless = k8s_util.one(objects, "Service", "shardd-worker")
                self.assertEqual(headless["spec"]["clusterIP"], "None")
                self.assertEqual(k8s_util.one(objects, "StatefulSet",
                                              "shardd-worker")
                                 ["spec"]["serviceName"], "shardd-worker")

                def admitted(policy_name, from_labels):
                    p = k8s_util.one(objects, "NetworkPolicy", policy_name)
                    return any(selects(peer["podSelector"], from_labels)
                               for rule in p["spec"]["ingress"]
                               for peer in rule["from"])

                coordinator = pods["shardd-coordinator"]
                worker = pods["shardd-worker"]
                policy = k8s_util.one(objects, "NetworkPolicy",
                                      "shardd-coordinator")
                self.assertTrue(selects(policy["spec"]["podSelector"],
                                        coordinator))
                self.assertTrue(admitted("shardd-coordinator", worker))
                self.assertTrue(admitted("shardd-coordinator", client_labels))
                self.assertFalse(admitted("shardd-coordinator",
                                          {"app": "other"}))
                self.assertFalse(admitted(
                    "shardd-coordinator",
                    {"app.kubernetes.io/component": "client"}))
                self.assertTrue(admitted("shardd-worker", coordinator))
                self.assertTrue(admitted("shardd-worker", worker))
                self.assertFalse(admitted("shardd-worker", client_labels))

    def test_secret_and_configmap_keys_exist(self):
        self.assertIsNone(self.secrets_error)
        self.assertEqual(sorted(self.secrets), ["shardd-tls", "shardd-tokens"])
        with open("tests/data/small_moe.json") as f:
            model = f.read()
        for (kubectl, kustomization), objects in self.rendered.items():
            config_maps = {o["metadata"]["name"]: o for o in
                           self.rendered[(kubectl, "overlays/cpu")]
                           if o["kind"] == "ConfigMap"}
            for o in objects:
                if "template" not in o.get("spec", {}):
                    continue
                for v in o["spec"]["template"]["spec"].get("volumes", []):
                    with self.subTest(kustomization=kustomization,
                                      volume=v["name"]):
                        if "secret" in v:
                            data = self.secrets[v["secret"]["secretName"]][
                                "data"]
                            for item in v["secret"]["items"]:
                                self.assertTrue(
                                    base64.b64decode(data[item["key"]]))
                        if "configMap" in v:
                            cm = config_maps[v["configMap"]["name"]]
                            self.assertEqual(cm["data"]["small_moe.json"],
                                             model)

    def test_model_copy_is_current(self):
        with open("tests/data/small_moe.json") as a, \
                open("deploy/k8s/base/small_moe.json") as b:
            self.assertEqual(a.read(), b.read(),
                             "cp tests/data/small_moe.json deploy/k8s/base/")


if __name__ == "__main__":
    unittest.main(verbosity=2)
