"""A coordinator and CPU workers on loopback, and `shardctl train` through
them, for the reference tests (transformers_test.py, safetensors_test.py,
diffusion_gemma_test.py)."""

import json
import os
import re
import subprocess
import time

WORKERS = 4
BATCH, SEQ, STEPS = 4, 16, 3
LR, BETAS, EPS, WEIGHT_DECAY = 3e-3, (0.9, 0.95), 1e-8, 0.1


class Cluster:
    """A coordinator and WORKERS CPU workers on loopback."""

    def __init__(self, bin_dir, work):
        self.bin, self.work, self.procs = bin_dir, work, []
        self.logs = []
        data = os.path.join(work, "coordinator")
        self.checkpoints = os.path.join(work, "checkpoints")
        self.spawn("coordinator", [f"{bin_dir}/server/shardd-coordinator",
                                   "--listen=127.0.0.1:0", f"--data-dir={data}",
                                   f"--checkpoint-dir={self.checkpoints}",
                                   f"--workers={WORKERS}"])
        port_file = os.path.join(data, "coordinator.port")
        deadline = time.time() + 30
        while not (os.path.exists(port_file) and os.path.getsize(port_file)):
            self.check_alive()
            if time.time() > deadline:
                raise RuntimeError("the coordinator published no port in 30 s")
            time.sleep(0.1)
        with open(port_file) as f:
            self.address = f"127.0.0.1:{f.read().strip()}"
        for i in range(WORKERS):
            self.spawn(f"worker{i}", [f"{bin_dir}/worker/shardd-worker",
                                      f"--coordinator={self.address}",
                                      "--listen=127.0.0.1:0",
                                      f"--checkpoint-root={self.checkpoints}",
                                      f"--requested-rank={i}"])
        deadline = time.time() + 60
        while True:
            self.check_alive()
            status = self.shardctl(["status", "--json"], timeout=10, check=False)
            if status.returncode == 0:
                workers = json.loads(status.stdout).get("workers", [])
                if sum(1 for w in workers if w.get("alive")) >= WORKERS:
                    return
            if time.time() > deadline:
                raise RuntimeError(f"{WORKERS} workers did not register in 60 s")
            time.sleep(0.2)

    def spawn(self, name, argv):
        log = os.path.join(self.work, name + ".log")
        self.logs.append(log)
        with open(log, "wb") as err:
            self.procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL,
                                               stderr=err))

    def check_alive(self):
        for proc, log in zip(self.procs, self.logs):
            if proc.poll() is not None:
                with open(log, errors="replace") as f:
                    tail = f.read()[-2000:]
                raise RuntimeError(f"{log} exited {proc.returncode}:\n{tail}")

    def shardctl(self, args, timeout=120, check=True):
        argv = [f"{self.bin}/client/shardctl", args[0],
                "--coordinator", self.address] + args[1:]
        run = subprocess.run(argv, capture_output=True, text=True,
                             timeout=timeout)
        if check and run.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {run.returncode}:\n"
                               f"{run.stdout}\n{run.stderr}")
        return run

    def shardctl_local(self, args):
        """A shardctl command that needs no coordinator."""
        argv = [f"{self.bin}/client/shardctl"] + args
        run = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        if run.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {run.returncode}:\n"
                               f"{run.stdout}\n{run.stderr}")
        return run

    def worker_log_sizes(self):
        return [os.path.getsize(log) for log in self.logs[1:]]

    def bytes_read_since(self, sizes):
        """Tensor bytes the workers logged reading from --init-from."""
        total = 0
        for log, start in zip(self.logs[1:], sizes):
            with open(log, errors="replace") as f:
                f.seek(start)
                for m in re.finditer(r"initialised its shards from \S+ \((\d+) bytes",
                                     f.read()):
                    total += int(m.group(1))
        return total

    def stop(self):
        for proc in reversed(self.procs):  # Workers first.
            if proc.poll() is None:
                proc.terminate()
        deadline = time.time() + 10
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def train(cluster, config, init_from, data, world, strategy, mixed,
          steps=STEPS, extra=()):
    """(loss, grad_norm) per step, the checkpoints the job saved, and the
    held-out loss of its evaluation after the last step (None without
    --eval-data in `extra`)."""
    args = ["train", "--model", config, "--init-from", init_from,
            "--data", data, "--data-order", "strided", "--steps", str(steps),
            "--global-batch", str(BATCH), "--seq", str(SEQ), "--lr", str(LR),
            "--beta1", str(BETAS[0]), "--beta2", str(BETAS[1]),
            "--eps", str(EPS), "--weight-decay", str(WEIGHT_DECAY),
            "--grad-clip", "0", "--dp", str(world), "--strategy", strategy,
            "--json"]
    if not mixed:
        args.append("--no-mixed-precision")
    run = cluster.shardctl(args + list(extra))
    lines = [json.loads(line) for line in run.stdout.splitlines()
             if line.startswith('{"event":"step"')]
    if [s["step"] for s in lines] != list(range(1, steps + 1)):
        raise RuntimeError(f"expected {steps} step lines:\n{run.stdout}")
    evals = [json.loads(line) for line in run.stdout.splitlines()
             if line.startswith('{"event":"eval"')]
    if "--eval-data" in extra and [e["step"] for e in evals] != [steps]:
        raise RuntimeError(f"expected one eval line:\n{run.stdout}")
    return ([(s["loss"], s["grad_norm"]) for s in lines],
            [s["checkpoint"] for s in lines if "checkpoint" in s],
            evals[-1]["eval_loss"] if evals else None)
