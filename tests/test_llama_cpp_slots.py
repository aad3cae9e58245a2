"""The two-slot acceptance check's own logic (``spectrain.eval.llama_cpp_slots``), without llama.cpp: the schedule,
the verdict against solo counts or a probe's prediction, the trace reader, and the server's library path."""

import threading
import time
from pathlib import Path

import pytest

from spectrain.eval.llama_cpp_server import server_env
from spectrain.eval.llama_cpp_slots import (concurrent_pair, pair_schedule, paired_completions, run_schedule, slot_rows,
                                            trace_summary, within)
from spectrain.heads.errors import SpectrainError


def test_pair_schedule_pairs_neighbours_both_ways_then_each_prompt_with_itself():
    assert pair_schedule(3) == [(0, 1), (1, 0), (1, 2), (2, 1), (2, 0), (0, 2), (0, 0), (1, 1), (2, 2)]
    assert pair_schedule(2) == [(0, 1), (1, 0), (0, 0), (1, 1)]
    with pytest.raises(SpectrainError, match="2 or more prompts"):
        pair_schedule(1)


def test_within_is_relative_and_allows_one_draft_at_zero():
    assert within(90, 100, 0.10) and within(110, 100, 0.10) and not within(89, 100, 0.10)
    assert within(1, 0, 0.10) and not within(2, 0, 0.10)


class FakeServer:
    """Answers like llama-server: a prompt's accepted count is its first token, less 5 when another request is in
    flight and ``cross_talk`` is set (the defect's shape), so the verdict has something to find."""

    def __init__(self, cross_talk: bool):
        self.cross_talk, self.active, self.lock, self.overlaps = cross_talk, 0, threading.Lock(), 0

    def complete(self, ids, n_predict, n_probs=0):
        with self.lock:
            self.active += 1
            crowded = self.active > 1  # another request was in flight when this one came, or came meanwhile
        time.sleep(0.2)
        with self.lock:
            crowded |= self.active > 1
            self.overlaps += crowded
            self.active -= 1
        accepted = ids[0] - (5 if crowded and self.cross_talk else 0)
        return {"tokens": list(ids) + [7] * 3, "timings": {"draft_n_accepted": accepted, "draft_n": 2 * ids[0]}}


def test_concurrent_pair_overlaps_and_keeps_the_order():
    server = FakeServer(cross_talk=False)
    a, b = concurrent_pair(server, [10], [20], 4)
    assert a["tokens"][0] == 10 and b["tokens"][0] == 20
    assert server.overlaps == 2  # both requests saw the other in flight


def test_paired_completions_decode_every_prompt_beside_another_in_order():
    server = FakeServer(cross_talk=False)
    out = paired_completions(server, [[10], [20], [30]], 4)  # (0, 1), then 2 beside 0 again
    assert [r["tokens"][0] for r in out] == [10, 20, 30]
    assert server.overlaps == 4  # every request had a neighbour in flight
    with pytest.raises(SpectrainError, match="2 or more prompts"):
        paired_completions(server, [[10]], 4)


@pytest.mark.parametrize("cross_talk", [False, True])
def test_slot_rows_finds_acceptance_lost_beside_another_request(cross_talk):
    schedule = run_schedule(FakeServer(cross_talk), [[40, 1], [30, 2], [20, 3]], 8, stagger_s=0.05)
    verdict = slot_rows(schedule, tolerance=0.10)
    assert verdict["pairings"] == 2 * len(pair_schedule(3)) and verdict["identical"] == verdict["pairings"]
    assert [r["solo"] for r in verdict["prompts"]] == ["40/80", "30/60", "20/40"]
    assert verdict["ok"] is (not cross_talk)
    if cross_talk:  # 20 - 5 = 15: 0.75 of solo, outside 10 %
        assert verdict["prompts"][2]["worst_ratio"] == pytest.approx(0.75)
        assert verdict["prompts"][2]["with_others"] == ["15/40"] * 4


def test_slot_rows_against_a_probe_prediction_and_changed_outputs():
    schedule = {"solo": [{"accepted": 5, "drafted": 9, "tokens": [1, 2]}, {"accepted": 3, "drafted": 9, "tokens": [3]}],
                "pairs": [{"prompts": [0, 1], "counts": [{"accepted": 5, "drafted": 9, "tokens": [1, 2]},
                                                         {"accepted": 3, "drafted": 9, "tokens": [4]}]}]}
    assert slot_rows(schedule, expected=[5, 3])["ok"]
    assert slot_rows(schedule, expected=[5, 3])["identical"] == 1  # prompt 1's paired output differs
    wrong = slot_rows(schedule, expected=[5, 6])
    assert not wrong["ok"] and wrong["prompts"][0]["ok"] and not wrong["prompts"][1]["ok"]


def _trace(rows_by_request, cands):
    """A SPEC_TRACE text: each request's feature rows as one batch run, then candidate lines."""
    lines = []
    for seq, rows in rows_by_request:
        lines += [f"feat seq={seq} pos={p} tok={t} f={v:.6f}" for p, t, v in rows]
    lines += [f"cand seq={seq} step=0 ib={seq} c={c} l=1.0,2.0,0.5" for seq, c in cands]
    return "\n".join(lines) + "\n"


def test_trace_summary_tells_whose_features_and_counts_shared_candidates():
    prompts, outputs = [[1, 5], [1, 6]], [[8], [9]]
    solo = [(1, [(0, 1, 10.0), (1, 5, 20.0), (2, 8, 30.0)]), (1, [(0, 1, 10.0), (1, 6, 50.0), (2, 9, 70.0)])]
    own = [(0, [(0, 1, 10.0), (1, 5, 20.0), (2, 8, 30.0)]), (1, [(0, 1, 10.0), (1, 6, 50.0), (2, 9, 70.0)])]
    text = _trace(solo + own, [(0, "4,5,6"), (1, "4,5,6"), (0, "1,2,3"), (1, "7,8,9")])
    summary = trace_summary(text, prompts, outputs)
    rows = summary["feature_rows"]
    assert rows["on_text"] == 6 and rows["equal_to_solo"] == 6
    assert rows["where_the_two_prompts_differ"] == 4 and rows["closer_to_own_solo_row"] == 4
    # the cand lines of the paired requests: one step shared, one not
    assert summary["two_slot_steps"] == {"steps": 2, "identical_candidates": 1}
    crossed = [(0, [(0, 1, 10.0), (1, 5, 50.0), (2, 8, 70.0)]), (1, [(0, 1, 10.0), (1, 6, 20.0), (2, 9, 30.0)])]
    rows = trace_summary(_trace(solo + crossed, []), prompts, outputs)["feature_rows"]
    assert rows["closer_to_own_solo_row"] == 0 and rows["equal_to_solo"] == 2  # position 0 is shared


def test_trace_summary_needs_a_solo_run_per_prompt():
    with pytest.raises(SpectrainError, match="solo run per prompt"):
        trace_summary(_trace([(0, [(0, 1, 1.0), (1, 5, 2.0)])], []), [[1, 5], [1, 6]], [[], []])


def test_server_env_puts_the_binary_directory_first(tmp_path, monkeypatch):
    monkeypatch.setenv("LD_LIBRARY_PATH", "/elsewhere")
    env = server_env(tmp_path / "bin" / "llama-server", {"SPEC_TRACE": "t.txt"})
    assert env["LD_LIBRARY_PATH"] == f"{(tmp_path / 'bin').resolve()}:/elsewhere"
    assert env["SPEC_TRACE"] == "t.txt"
    monkeypatch.delenv("LD_LIBRARY_PATH")
    assert server_env(Path("/x/llama-server"))["LD_LIBRARY_PATH"] == "/x"


def test_f32_target_is_written_once_and_smollm2_goes_through_bf16(tmp_path, monkeypatch):
    from spectrain.eval.engine_compare import f32_target
    from spectrain.heads.serving import llama_cpp

    calls = []

    def fake(source, target, dtype, through=None):
        calls.append((dtype, through))
        Path(target).write_bytes(b"gguf")
        return target

    monkeypatch.setattr(llama_cpp, "write_verifier_gguf", fake)
    assert f32_target("bundled:smollm2", tmp_path / "s.gguf", tmp_path) == tmp_path / "target-f32.gguf"
    f32_target("bundled:smollm2", tmp_path / "s.gguf", tmp_path)  # already there: not written again
    assert calls == [("float32", "bfloat16")]
    (tmp_path / "other").mkdir()
    f32_target("my/model", tmp_path / "s.gguf", tmp_path / "other")  # another verifier: its own weights as they are
    assert calls[-1] == ("float32", None)


def test_complete_together_posts_every_prompt_in_one_request(tmp_path):
    """LlamaServer.complete_together sends the prompts as one request (llama-server queues their tasks at once) and
    returns one completion per prompt, in order; a reply with another count is refused naming it."""
    import json
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from spectrain.eval.llama_cpp_server import LlamaServer

    bodies, drop = [], []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802  (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bodies.append(body)
            prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
            out = [{"tokens": [p[-1] + 1] * body["n_predict"], "timings": {"predicted_ms": 10.0 * (i + 1)}}
                   for i, p in enumerate(prompts)][:len(prompts) - len(drop)]
            data = json.dumps(out if isinstance(body["prompt"][0], list) else out[0]).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    httpd = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        server = LlamaServer(Path("llama-server"), Path("t.gguf"), [], tmp_path / "log")
        server.port = httpd.server_address[1]
        got = server.complete_together([[1, 2], [5, 6], [1, 2]], 3)
        assert len(bodies) == 1 and bodies[0]["prompt"] == [[1, 2], [5, 6], [1, 2]]
        assert [g["tokens"] for g in got] == [[3, 3, 3], [7, 7, 7], [3, 3, 3]]
        assert [g["timings"]["predicted_ms"] for g in got] == [10.0, 20.0, 30.0]
        assert server.complete([4], 2)["tokens"] == [5, 5]  # one prompt: one object, as before
        drop.append(1)
        with pytest.raises(SpectrainError, match="2 completions for 3 prompts"):
            server.complete_together([[1], [2], [3]], 1)
    finally:
        httpd.shutdown()
