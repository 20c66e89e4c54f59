"""examples/from_torch.py end to end against a coordinator and 2 CPU workers.

Runs under Bazel through run_py_test.sh from the runfiles root.
"""

import json
import math
import os
import pathlib
import subprocess
import sys
import unittest

try:
    import grpc  # noqa: F401
    import google.protobuf  # noqa: F401
    import torch
except ImportError as error:
    # A failure, not a skip: tools/setup.sh installs them.
    sys.exit(f"FAIL: {error}; this test needs torch, grpcio and protobuf "
             "from the tests' Python environment (run tools/test.sh, or "
             "tools/python_env.sh)")

import shardd

import cluster

EXAMPLE = "client/python/examples/from_torch.py"
sys.path.insert(0, os.path.dirname(os.path.abspath(EXAMPLE)))
import from_torch  # noqa: E402

SMALL_MOE = pathlib.Path("tests/data/small_moe.json")
WORKERS = 2


def without_comments(value):
    """The spec without `_comment` members, kinds defaulted as the parser
    does, so two specs of the same tree compare equal."""
    if isinstance(value, dict):
        out = {k: without_comments(v) for k, v in value.items()
               if not k.startswith("_")}
        if "params" in out or "children" in out or "name" in out:
            if "shape" not in out:  # A module, not a parameter.
                out.setdefault("kind", "generic")
        return out
    if isinstance(value, list):
        return [without_comments(v) for v in value]
    return value


def small_moe_module():
    """A torch module with tests/data/small_moe.json's dimensions."""
    dims = json.loads(SMALL_MOE.read_text())["dims"]
    return from_torch.TinyMoeForCausalLM(
        vocab=dims["vocab_size"], hidden=dims["hidden_size"],
        layers=dims["num_layers"], experts=dims["num_experts"],
        top_k=dims["top_k"], moe_intermediate=dims["moe_intermediate_size"],
        dense_intermediate=dims["dense_intermediate_size"],
        eps=dims["rms_norm_eps"])


class SpecTest(unittest.TestCase):
    """The module walk alone (no coordinator)."""

    def test_walk_reproduces_small_moe(self):
        spec = from_torch.native_spec(small_moe_module())
        expected = without_comments(json.loads(SMALL_MOE.read_text()))
        self.assertEqual(without_comments(spec), expected)

    def test_frozen_dtype_and_untied_head(self):
        module = from_torch.TinyMoeForCausalLM(vocab=32, hidden=16, layers=3,
                                               experts=4, top_k=1,
                                               moe_intermediate=8,
                                               dense_intermediate=0)
        module.lm_head.weight = torch.nn.Parameter(torch.zeros(32, 16))
        module.model.layers[0].moe.gate.weight.requires_grad_(False)
        module.model.norm.weight.data = module.model.norm.weight.data.to(
            torch.bfloat16)
        spec = from_torch.native_spec(module)
        self.assertEqual(spec["dims"]["num_layers"], 3)
        self.assertEqual(spec["dims"]["top_k"], 1)
        self.assertFalse(spec["dims"]["tie_word_embeddings"])
        self.assertNotIn("dense_intermediate_size", spec["dims"])
        model, head = spec["root"]["children"]
        self.assertNotIn("tied_to", head["params"][0])
        layer0 = model["children"][1]["children"][0]
        self.assertEqual([c["name"] for c in layer0["children"]],
                         ["moe", "input_layernorm"])
        gate = layer0["children"][0]["children"][0]
        self.assertEqual(gate["kind"], "router")
        self.assertTrue(gate["params"][0]["frozen"])
        norm = model["children"][2]
        self.assertEqual(norm["params"][0]["dtype"], "bfloat16")


class TorchExampleTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.cluster = cluster.Cluster(WORKERS).start()
        try:
            cls.coordinator = shardd.Coordinator(cls.cluster.address)
            cls.cluster.wait_for_workers(cls.coordinator)
        except BaseException:
            cls.cluster.stop()
            raise

    @classmethod
    def tearDownClass(cls):
        cls.coordinator.close()
        cls.cluster.stop()

    def test_torch_spec_is_the_same_model_as_small_moe(self):
        # The coordinator's model id hashes the parsed spec and the options:
        # equal ids mean the walk produced the same tree.
        module = small_moe_module()
        from_module = self.coordinator.submit_model(
            from_torch.native_spec(module), dp=WORKERS)
        from_file = self.coordinator.submit_model(SMALL_MOE, dp=WORKERS)
        self.assertEqual(from_module.model_id, from_file.model_id)
        self.assertEqual(from_module.summary.total_params,
                         from_torch.unique_parameters(module))

    def test_example_end_to_end(self):
        steps = 8
        run = subprocess.run(
            [sys.executable, EXAMPLE, "--coordinator", self.cluster.address,
             "--steps", str(steps), "--json"],
            capture_output=True, text=True, timeout=120)
        self.assertEqual(run.returncode, 0,
                         f"{run.stderr}\n{self.cluster.logs()}")
        result = json.loads(run.stdout)
        self.assertEqual(result["total_params"], result["torch_params"])
        self.assertEqual(result["world_size"], WORKERS)
        self.assertGreater(result["units"], 0)
        self.assertGreater(result["peak_unsharded_bytes"], 0)
        losses = result["losses"]
        self.assertEqual(len(losses), steps)
        self.assertTrue(all(math.isfinite(x) for x in losses), losses)
        self.assertLess(sum(losses[-2:]) / 2, sum(losses[:2]) / 2, losses)


if __name__ == "__main__":
    cluster.exit_on_sigterm()
    unittest.main(verbosity=2)
