"""The Python client against a real coordinator and 2 CPU workers.

Runs under Bazel through run_py_test.sh (Debian's /usr/bin/python3 with the
package and its generated modules on PYTHONPATH) from the runfiles root.
"""

import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import unittest

try:
    import grpc  # noqa: F401
    import google.protobuf  # noqa: F401
except ImportError as error:
    # A failure, not a skip: tools/setup.sh installs them.
    sys.exit(f"FAIL: {error}; this test needs Debian's python3-grpcio and "
             "python3-protobuf for /usr/bin/python3 (run tools/setup.sh)")

import shardd
from shardd import v1

import cluster

SMALL_MOE = pathlib.Path("tests/data/small_moe.json")
WORKERS = 2
STEPS = 12


def small_moe() -> dict:
    return json.loads(SMALL_MOE.read_text())


class ClientIntegrationTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.cluster = cluster.Cluster(WORKERS).start()
        try:
            cls.coordinator = shardd.Coordinator(cls.cluster.address, timeout=30)
            cls.cluster.wait_for_workers(cls.coordinator)
        except BaseException:
            cls.cluster.stop()
            raise

    @classmethod
    def tearDownClass(cls):
        cls.coordinator.close()
        cls.cluster.stop()

    def test_submit_plan_train_watch(self):
        submitted = self.coordinator.submit_model(SMALL_MOE, dp=WORKERS)
        self.assertTrue(submitted.model_id)
        self.assertEqual(submitted.plan.world_size, WORKERS)
        self.assertGreater(submitted.summary.total_params, 0)
        self.assertGreater(submitted.summary.expert_params, 0)
        # The stored plan, and a new one for other options.
        stored = self.coordinator.plan(submitted.model_id)
        self.assertEqual(stored.fingerprint, submitted.plan.fingerprint)
        single = self.coordinator.plan(submitted.model_id, dp=1)
        self.assertEqual(single.world_size, 1)
        # With a micro-batch the plan counts activations; recomputing every
        # layer holds fewer of them.
        kept = self.coordinator.plan(submitted.model_id, dp=WORKERS,
                                     micro_batch_size=8, seq_len=32)
        recomputed = self.coordinator.plan(
            submitted.model_id, dp=WORKERS, micro_batch_size=8, seq_len=32,
            activation_checkpointing="all")
        self.assertGreater(kept.memory.peak_activation_bytes, 0)
        self.assertEqual(kept.memory.peak_total_bytes,
                         kept.memory.persistent_bytes
                         + kept.memory.peak_step_bytes)
        self.assertLess(recomputed.memory.peak_activation_bytes,
                        kept.memory.peak_activation_bytes)
        # A GPU worker keeps bf16 activations under mixed precision.
        on_gpu = self.coordinator.plan(
            submitted.model_id, dp=WORKERS, micro_batch_size=8, seq_len=32,
            worker_device="cuda")
        self.assertEqual(on_gpu.activations.storage_bytes, 2)
        self.assertLess(on_gpu.memory.peak_activation_bytes,
                        kept.memory.peak_activation_bytes)
        with self.assertRaises(shardd.ShardError) as bad:
            self.coordinator.plan(submitted.model_id, dp=WORKERS,
                                  worker_device="tpu")
        self.assertIn("worker_device", str(bad.exception))
        # Submitting the same spec as a dict gives the same model.
        again = self.coordinator.submit_model(small_moe(), dp=WORKERS)
        self.assertEqual(again.model_id, submitted.model_id)

        job = self.coordinator.train(submitted.model_id, steps=STEPS,
                                     global_batch=16, seq_len=32, lr=0.01,
                                     seed=3)
        self.assertEqual(job.world_size, WORKERS)
        events = list(self.coordinator.watch(job.job_id, idle_timeout=60))
        self.assertEqual([e.step for e in events], list(range(1, STEPS + 1)))
        self.assertTrue(events[-1].done)
        self.assertFalse(any(e.done for e in events[:-1]))
        losses = [e.loss for e in events]
        for loss in losses:
            self.assertTrue(math.isfinite(loss), losses)
        # Starts near ln(vocab) (random init), falls clearly over the
        # steps, and stays above the data's entropy rate (the floor).
        vocab = small_moe()["dims"]["vocab_size"]
        self.assertGreater(losses[0], 0.5 * math.log(vocab), losses)
        self.assertLess(losses[0], 1.5 * math.log(vocab), losses)
        head, tail = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
        self.assertLess(tail, 0.9 * head, losses)
        self.assertLess(losses[-1], losses[0], losses)
        entropy = events[-1].data_entropy_rate
        self.assertGreater(entropy, 0)
        self.assertGreater(min(losses), 0.9 * entropy, losses)
        for event in events:
            self.assertEqual(event.total_steps, STEPS)
            self.assertEqual(event.peak_unsharded_bytes,
                             event.planned_peak_unsharded_bytes)
            self.assertGreater(event.planned_peak_activation_bytes, 0)
            self.assertEqual(event.peak_activation_bytes,
                             event.planned_peak_activation_bytes)

        info = job.info()
        self.assertEqual(info.state, v1.JOB_DONE)
        self.assertEqual(info.steps_done, STEPS)
        self.assertAlmostEqual(info.loss, losses[-1])
        # A finished job can be watched again from a later step.
        replay = list(job.events(from_step=STEPS - 1))
        self.assertEqual([e.step for e in replay], [STEPS - 1, STEPS])
        status = self.coordinator.status()
        self.assertIn(submitted.model_id, [m.model_id for m in status.models])

    def test_train_submits_a_spec_over_the_live_workers(self):
        job = self.coordinator.train(SMALL_MOE, steps=2, global_batch=16,
                                     seq_len=16)
        self.assertIsNotNone(job.plan)
        self.assertEqual(job.plan.world_size, WORKERS)
        events = job.wait(idle_timeout=60)
        self.assertEqual(len(events), 2)

    def test_bad_spec_is_invalid_argument_naming_the_field(self):
        spec = small_moe()
        spec["dims"]["top_k"] = 9  # More than the 8 experts.
        with self.assertRaises(shardd.ShardError) as raised:
            self.coordinator.submit_model(spec, dp=WORKERS)
        self.assertEqual(raised.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("dims.top_k", raised.exception.message)
        self.assertEqual(raised.exception.rpc, "SubmitModel")

        spec = small_moe()
        spec["root"]["children"][1]["params"][0]["shape"] = [64, 0]
        with self.assertRaises(shardd.ShardError) as raised:
            self.coordinator.plan(spec, dp=WORKERS)
        self.assertEqual(raised.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("root.children[1].params[0].shape[1]",
                      raised.exception.message)

    def test_lora_adapters_are_the_only_trainable_parameters(self):
        full = self.coordinator.submit_model(SMALL_MOE, dp=WORKERS).summary
        lora = self.coordinator.submit_model(
            SMALL_MOE, dp=WORKERS, lora_rank=2, lora_alpha=4,
            lora_targets=["experts"]).summary
        adapters = lora.total_params - full.total_params
        self.assertGreater(adapters, 0)
        self.assertEqual(lora.trainable_params, adapters)
        with self.assertRaises(shardd.ShardError) as raised:
            self.coordinator.submit_model(SMALL_MOE, dp=WORKERS, lora_rank=2,
                                          lora_targets=["nope"])
        self.assertEqual(raised.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("options.lora.targets: 'nope' matches no linear module",
                      raised.exception.message)
        with self.assertRaises(shardd.ShardError) as raised:
            self.coordinator.submit_model(SMALL_MOE, dp=WORKERS, lora_rank=2)
        self.assertIn("lora_targets", raised.exception.message)

    def test_bad_train_config_is_invalid_argument_naming_the_field(self):
        model_id = self.coordinator.submit_model(SMALL_MOE, dp=WORKERS).model_id
        with self.assertRaises(shardd.ShardError) as raised:
            self.coordinator.train(model_id, steps=2, global_batch=3, seq_len=16)
        self.assertEqual(raised.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("config.global_batch", raised.exception.message)

    def test_unknown_ids_are_not_found(self):
        with self.assertRaises(shardd.ShardError) as raised:
            self.coordinator.plan("m-does-not-exist")
        self.assertEqual(raised.exception.code, grpc.StatusCode.NOT_FOUND)
        with self.assertRaises(shardd.ShardError) as raised:
            list(self.coordinator.watch("j-does-not-exist"))
        self.assertEqual(raised.exception.code, grpc.StatusCode.NOT_FOUND)

    def test_list_strategies(self):
        response = self.coordinator.list_strategies()
        self.assertIn("default", [s.name for s in response.strategies])
        self.assertIn("MixtralForCausalLM", response.supported_architectures)


class LocalErrorsTest(unittest.TestCase):
    """Client options checked before anything is sent."""

    def assertInvalid(self, fragment, **kwargs):
        with self.assertRaises(shardd.ShardError) as raised:
            shardd.Coordinator("127.0.0.1:1", connect_timeout=None, **kwargs)
        self.assertEqual(raised.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn(fragment, raised.exception.message)

    def test_options(self):
        self.assertInvalid("tls_cert and tls_key", tls_cert="c.pem")
        self.assertInvalid("tls_cert: a client certificate needs tls_ca",
                           tls_cert="c.pem", tls_key="c.key")
        self.assertInvalid("tls_ca: cannot read", tls_ca="/nonexistent/ca.pem")
        self.assertInvalid("token_file: cannot read",
                           token_file="/nonexistent/token")
        self.assertInvalid("timeout: must be > 0", timeout=0)

    def test_no_server_is_unavailable(self):
        with self.assertRaises(shardd.ShardError) as raised:
            shardd.Coordinator("127.0.0.1:1", connect_timeout=0.2)
        self.assertEqual(raised.exception.code, grpc.StatusCode.UNAVAILABLE)
        self.assertIn("127.0.0.1:1", raised.exception.message)


class TlsAndTokenTest(unittest.TestCase):
    """A coordinator with mutual TLS and a client token (no workers)."""

    @classmethod
    def setUpClass(cls):
        cls.certs = tempfile.mkdtemp(prefix="certs_",
                                     dir=os.environ.get("TEST_TMPDIR"))
        subprocess.run(["tools/make_test_certs.sh", cls.certs], check=True,
                       timeout=60)
        c = cls.certs
        cls.cluster = cluster.Cluster(
            WORKERS, start_workers=False,
            coordinator_flags=[f"--tls-cert={c}/server.pem",
                               f"--tls-key={c}/server.key",
                               f"--tls-client-ca={c}/ca.pem",
                               f"--client-token-file={c}/client.token",
                               f"--worker-token-file={c}/worker.token"]).start()

    @classmethod
    def tearDownClass(cls):
        cls.cluster.stop()

    def connect(self, **kwargs):
        c = self.certs
        options = dict(tls_ca=f"{c}/ca.pem", tls_cert=f"{c}/client.pem",
                       tls_key=f"{c}/client.key",
                       token_file=f"{c}/client.token", connect_timeout=10)
        options.update(kwargs)
        return shardd.Coordinator(self.cluster.address, **options)

    def test_client_token_over_mutual_tls(self):
        with self.connect() as coordinator:
            self.assertEqual(len(coordinator.status().workers), 0)

    def test_wrong_or_missing_token_is_refused(self):
        wrong = os.path.join(self.certs, "wrong.token")
        pathlib.Path(wrong).write_text("not-the-token\n")
        with self.connect(token_file=wrong) as coordinator:
            with self.assertRaises(shardd.ShardError) as raised:
                coordinator.status()
            self.assertEqual(raised.exception.code,
                             grpc.StatusCode.UNAUTHENTICATED)
        # The worker token is a token of the other role.
        with self.connect(token_file=f"{self.certs}/worker.token") as coordinator:
            with self.assertRaises(shardd.ShardError) as raised:
                coordinator.status()
            self.assertEqual(raised.exception.code,
                             grpc.StatusCode.PERMISSION_DENIED)
        # No token at all.
        with self.connect(token_file=None) as coordinator:
            with self.assertRaises(shardd.ShardError) as raised:
                coordinator.status()
            self.assertEqual(raised.exception.code,
                             grpc.StatusCode.UNAUTHENTICATED)

    def test_plaintext_client_cannot_connect(self):
        with self.assertRaises(shardd.ShardError) as raised:
            shardd.Coordinator(self.cluster.address, connect_timeout=1)
        self.assertEqual(raised.exception.code, grpc.StatusCode.UNAVAILABLE)


if __name__ == "__main__":
    cluster.exit_on_sigterm()
    unittest.main(verbosity=2)
