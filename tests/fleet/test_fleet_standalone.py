"""Fleet jobs trained by standalone `harvest train` processes (no server), on CPU:

- every_step: two members, each on half of every step's samples, write the adapter one
  process writes on the whole batch (exact data parallelism, to 1e-5);
- periodic: three members finish the job while one of them is SIGKILLed mid-run and
  started again (it rejoins, gets the fleet's weights and trains on), and the final
  adapter's loss is within the single-process run's noise.
"""

from __future__ import annotations

import json
import re
import signal
import statistics
import subprocess
import sys
import time

import pytest

from harvest.sglang.server import free_port
from tests.fleet.helpers import PROJECT, adapter_loss, adapter_tensors, member_env, start_member, write_fleet_job

pytestmark = [pytest.mark.slow]


def _finish(procs, timeout_s):
    deadline = time.monotonic() + timeout_s
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append("timeout")
    return codes


@pytest.mark.timeout(600)
def test_every_step_two_members_equal_one_process(tiny_llama_path, tmp_path):
    solo = write_fleet_job(tmp_path / "solo", tiny_llama_path, port=None, max_steps=4)
    fleet = write_fleet_job(tmp_path / "fleet", tiny_llama_path, port=free_port(), max_steps=4,
                            fleet={"sync": "every_step", "max_members": 2})
    codes = _finish([start_member(solo, tmp_path / "solo.log")]
                    + [start_member(fleet, tmp_path / f"member{i}.log") for i in range(2)], 400)
    assert codes == [0, 0, 0], [(tmp_path / f).read_text()[-2000:] for f in ("solo.log", "member0.log", "member1.log")]
    one, two = adapter_tensors(tmp_path / "solo" / "adapter"), adapter_tensors(tmp_path / "fleet" / "adapter")
    assert one.keys() == two.keys()
    assert max(float((one[k] - two[k]).abs().max()) for k in one) < 1e-5
    assert max(float(t.abs().max()) for k, t in one.items() if "lora_B" in k) > 1e-3  # it trained: B left zero


ROUND_LINE = re.compile(r"round (\d+): (\d+) member\(s\), (\d+) token\(s\) \((\d+) of them this member's\), (\d+)/(\d+)")


def _rounds(log):
    return [tuple(int(g) for g in m.groups()) for m in ROUND_LINE.finditer(log.read_text(errors="replace"))]


def _wait_for(predicate, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


@pytest.mark.timeout(900)
def test_periodic_three_members_one_killed_and_restarted(tiny_llama_path, tmp_path):
    steps = 1200  # long enough that the restarted member (~10 s to start) finds the job running
    keys = dict(learning_rate=5e-3)
    solo = write_fleet_job(tmp_path / "solo", tiny_llama_path, port=None, max_steps=steps, **keys)
    assert _finish([start_member(solo, tmp_path / "solo.log")], 400) == [0]
    port = free_port()
    store = subprocess.Popen([sys.executable, "-m", "harvest.cli", "fleet-store", f"127.0.0.1:{port}"], cwd=PROJECT,
                             env=member_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert "serving on" in store.stdout.readline()
        fleet = write_fleet_job(tmp_path / "fleet", tiny_llama_path, port=port, max_steps=steps,
                                fleet={"sync_interval_s": 1.0, "host_store": "never"}, **keys)
        logs = [tmp_path / f"member{i}.log" for i in range(3)]
        members = [start_member(fleet, log) for log in logs]
        # Kill one once the fleet has averaged with all three and is well into the job.
        assert _wait_for(lambda: any(r[1] == 3 and r[4] >= steps // 20 for r in _rounds(logs[2])), 300), \
            logs[2].read_text()[-3000:]
        members[2].send_signal(signal.SIGKILL)
        members[2].wait()
        killed_at = max(r[4] for r in _rounds(logs[2]))
        assert killed_at < steps, "the job ended before the kill: make it longer"
        restarted_log = tmp_path / "member2-restarted.log"
        members.append(start_member(fleet, restarted_log))
        codes = _finish([members[0], members[1], members[3]], 600)
    finally:
        store.send_signal(signal.SIGTERM)
        store.wait(timeout=30)
    assert codes == [0, 0, 0], [log.read_text()[-2000:] for log in (logs[0], logs[1], restarted_log)]
    survivors = [_rounds(log) for log in logs[:2]]
    restarted = _rounds(restarted_log)
    # The restarted member rejoined: it took part in a round with the others and trained in it.
    assert any(r[1] >= 2 for r in restarted) and any(r[3] > 0 for r in restarted), restarted_log.read_text()[-3000:]
    assert max(r[4] for rounds in survivors + [restarted] for r in rounds) == steps  # every step committed
    # The dead member's unsynced steps went back to the queue (or it had none at the kill).
    text = "".join(log.read_text(errors="replace") for log in logs[:2] + [restarted_log])
    assert "given back" in text or "re-queued" in text or "silent" in text or killed_at == steps
    # Every step's samples were trained into the final weights; the loss is the solo run's, within its noise.
    solo_losses = [json.loads(line)["loss"] for line in (tmp_path / "solo" / "adapter" / "trainer_log.jsonl").read_text().splitlines()]
    noise = statistics.pstdev(solo_losses[-20:])
    evaluated = range(0, steps, 20)
    solo_loss = adapter_loss(solo, tmp_path / "solo" / "adapter", evaluated)
    fleet_loss = adapter_loss(solo, tmp_path / "fleet" / "adapter", evaluated)
    print(f"solo loss {solo_loss:.4f}, fleet loss {fleet_loss:.4f}, solo noise (stdev of its last 20 step losses) "
          f"{noise:.4f}, killed at {killed_at}/{steps} committed")
    assert abs(fleet_loss - solo_loss) <= noise, (solo_loss, fleet_loss, noise)
