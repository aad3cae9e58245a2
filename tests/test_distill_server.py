"""spectrain-distill --server: replies from OpenAI-compatible endpoints (an in-process fake engine on 127.0.0.1 serving
a tiny random verifier), the served-verifier check, endpoint failures, resume, --block_size truncation counts."""

from __future__ import annotations

import json

import pytest

import spectrain.data.distill as distill_mod
from spectrain.data.engine import (Completion, Endpoint, EndpointDown, Parting, first_parting, kernel_spread,
                                   parse_completion)
from spectrain.heads.errors import SpectrainError
from spectrain.heads.report import median_range
from spectrain.heads.verifier import load_verifier
from tests.fake_engine import FakeEngine

RECORDS = [{"messages": [{"role": "user", "content": f"tell me of the king {i}"},
                         {"role": "assistant", "content": "an old answer we replace"},
                         {"role": "user", "content": "and the queen?"}]} for i in range(7)]
RECORDS += [{"turns": ["what is the river", "and the hill"]}, {"messages": [{"role": "assistant", "content": "x"}]}]


@pytest.fixture(scope="module")
def tiny(verifier_factory):
    path = verifier_factory("llama", False)
    return path, load_verifier(str(path), dtype="float32")


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    return path


@pytest.fixture
def engine(tiny):
    engines = []

    def start(verifier=None, **kw):
        e = FakeEngine(verifier or tiny[1], **kw)
        engines.append(e)
        return e

    yield start
    for e in engines:
        e.close()


def argv(tiny, data_file, out, *servers, extra=()):
    return ["--verifier", str(tiny[0]), "--data", str(data_file), "--out", str(out), "--max_new_tokens", "6",
            "--dtype", "float32", "--device", "cpu", "--check_tokens", "12", "--retry_backoff", "0",
            "--retries", "1", *[a for s in servers for a in ("--server", s)], *extra]


def rows_of(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def conversations(path):
    return {r["id"]: (r["conversations"], r.get("stopped_by_loop", False)) for r in rows_of(path)}


def summary_of(capsys):
    return json.loads(open(capsys.readouterr().out.strip().splitlines()[-1]).read())


@pytest.fixture(scope="module")
def local_rows(tiny, data_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("local") / "local.jsonl"
    distill_mod.main(argv(tiny, data_file, out))
    return out


@pytest.mark.parametrize("layout", ["vllm", "llama", "text"])
def test_served_greedy_equals_the_local_loop(tmp_path, tiny, data_file, engine, local_rows, layout, capsys):
    """T = 0, fp32: the endpoint's replies are the local loop's, row for row; the check passes; metadata says so."""
    e = engine(layout=layout)
    out = tmp_path / "served.jsonl"
    capsys.readouterr()
    distill_mod.main(argv(tiny, data_file, out, e.url, extra=["--prompt_format", "text"] if layout == "text" else []))
    summary = summary_of(capsys)
    assert conversations(out) == conversations(local_rows) and len(rows_of(out)) == 8
    assert all(len(c) == 4 for c, _ in conversations(out).values())  # two turns each, replies kept
    check = summary["served"]["verifier_check"]["endpoints"][e.url]
    assert check["equal"] == 4 and not check["near_ties"]
    assert check["compared"] == ("text re-tokenized" if layout == "text" else "token ids")
    meta = json.loads(out.with_name(out.name + ".meta.json").read_text())
    assert meta["served_runs"][0]["endpoints"] == [e.url] and meta["served_runs"][0]["models"] == {e.url: "tiny"}
    assert meta["generator"]["api"] == "completions" and rows_of(out)[0]["generation"] == {
        k: v for k, v in meta.items() if k != "served_runs"}
    # The prompt went as the verifier's own template rendered here: token ids (text for TGI-style engines).
    tok = tiny[1].tokenizer
    first = tok(tok.apply_chat_template([{"role": "user", "content": "tell me of the king 0"}],
                                        add_generation_prompt=True, tokenize=False), add_special_tokens=False)["input_ids"]
    assert first in e.prompts


def test_another_model_is_caught_and_nothing_is_written(tmp_path, tiny, data_file, engine, verifier_factory, capsys):
    other = load_verifier(str(verifier_factory("llama", False, seed=1)), dtype="float32")
    e = engine(other)
    out = tmp_path / "d.jsonl"
    with pytest.raises(SystemExit) as exit_:
        distill_mod.main(argv(tiny, data_file, out, e.url))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "does not serve this verifier: probe 0" in err
    assert "at generated token 0: local " in err and "top-2 margins: local" in err and "served " in err
    assert not out.exists() and not out.with_name(out.name + ".meta.json").exists()


def test_skip_verifier_check_is_recorded(tmp_path, tiny, data_file, engine, verifier_factory, capsys, monkeypatch):
    other = load_verifier(str(verifier_factory("llama", False, seed=1)), dtype="float32")
    e = engine(other)
    out = tmp_path / "d.jsonl"
    loaded = []
    monkeypatch.setattr("spectrain.heads.verifier.load_verifier", lambda *a, **k: loaded.append(a))
    capsys.readouterr()
    distill_mod.main(argv(tiny, data_file, out, e.url, extra=["--skip_verifier_check"]))
    summary = summary_of(capsys)
    assert not loaded  # only the tokenizer was loaded
    meta = json.loads(out.with_name(out.name + ".meta.json").read_text())
    assert meta["served_runs"][0]["verifier_check"]["skipped"] is True
    assert summary["served"]["verifier_check"]["skipped"] is True and len(rows_of(out)) == 8


def test_two_endpoints_one_dying_lose_and_double_nothing(tmp_path, tiny, data_file, engine, local_rows, capsys):
    healthy, dying = engine(), engine(die_after=4 + 3)  # the 4 probes, then 3 turns: it dies mid-conversation
    out = tmp_path / "d.jsonl"
    capsys.readouterr()
    distill_mod.main(argv(tiny, data_file, out, healthy.url, dying.url, extra=["--in_flight", "2"]))
    summary = summary_of(capsys)
    ids = [r["id"] for r in rows_of(out)]
    assert sorted(ids) == sorted(set(ids)) == list(range(8))
    assert conversations(out) == conversations(local_rows)
    assert list(summary["dropped_endpoints"]) == [dying.url]
    finished = summary["finished_by_endpoint"]
    assert finished[dying.url] >= 1 and finished[healthy.url] >= 1 and sum(finished.values()) == 8


def test_the_only_endpoint_dying_stops_and_a_rerun_resumes(tmp_path, tiny, data_file, engine, capsys):
    straight = tmp_path / "straight.jsonl"
    e = engine()
    distill_mod.main(argv(tiny, data_file, straight, e.url, extra=["--in_flight", "1"]))
    dying = engine(die_after=4 + 7)  # probes, three conversations (2 turns each), one turn of the fourth
    out = tmp_path / "d.jsonl"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        distill_mod.main(argv(tiny, data_file, out, dying.url, extra=["--in_flight", "1"]))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "no endpoint left with 5 conversations to go" in err and dying.url in err
    assert len(rows_of(out)) == 3
    with open(out, "a") as f:
        f.write('{"id": 99, "conversations": [{"fr')  # a torn last line from a kill mid-write
    distill_mod.main(argv(tiny, data_file, out, engine().url, extra=["--in_flight", "1"]))  # another server
    assert out.read_text() == straight.read_text()
    meta = json.loads(out.with_name(out.name + ".meta.json").read_text())
    assert len(meta["served_runs"]) == 2 and meta["served_runs"][0]["endpoints"] != meta["served_runs"][1]["endpoints"]


@pytest.mark.parametrize("fault, message", [
    ("bad_json", "answered POST /v1/completions with something that is not JSON"),
    ("missing_text", "malformed answer to POST /v1/completions: choices[0] has no text"),
    ("http400", "said: HTTP 400: engine says no (400). Everything answered so far is on disk"),
    ("http503", "HTTP 503 to POST /v1/completions: engine says no (503) (after 2 tries)"),
])
def test_bad_answers_are_named_and_nothing_is_half_written(tmp_path, tiny, data_file, engine, fault, message, capsys):
    e = engine(fault=fault)
    out = tmp_path / "d.jsonl"
    with pytest.raises(SystemExit) as exit_:
        distill_mod.main(argv(tiny, data_file, out, e.url, extra=["--skip_verifier_check"]))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and e.url in err and message in err
    assert not out.exists() or out.read_text() == ""


def test_a_refused_request_ends_its_conversation_only(tmp_path, tiny, data_file, engine, local_rows, capsys):
    """A 4xx on one conversation's request (past the engine's context, or refused outright) ends that conversation;
    the others are written as the local loop writes them; a rerun asks the unwritten one again."""
    tok = tiny[1].tokenizer
    local = conversations(local_rows)
    first = [tok(tok.apply_chat_template([{"role": "user", "content": c[0]["value"]}], add_generation_prompt=True,
                                         tokenize=False), add_special_tokens=False)["input_ids"] for c, _ in local.values()]
    second = [tok(tok.apply_chat_template([{"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]}
                                           for t in c[:3]], add_generation_prompt=True, tokenize=False),
                  add_special_tokens=False)["input_ids"] for c, _ in local.values() if len(c) >= 3]
    context = max(map(len, first)) + 6  # every first turn fits with its 6-token reply; no second turn does
    assert min(map(len, second)) + 6 > context and len(second) == len(local) == 8
    e = engine(max_context=context, refuse_text="king 3")
    out = tmp_path / "d.jsonl"
    capsys.readouterr()
    skip = ["--skip_verifier_check"]  # its probes are longer than this engine's tiny context
    distill_mod.main(argv(tiny, data_file, out, e.url, extra=skip))
    summary = summary_of(capsys)
    assert summary["refused"] == 1 and summary["turns_refused"] == 7 and summary["rows"] == 7
    assert summary["refusals"] == {"HTTP 400: prompt refused by policy": 1,
                                   f"HTTP 400: This model's maximum context length is {context} tokens": 7}
    written = conversations(out)
    assert 3 not in written and {i: c[:2] for i, (c, _) in local.items() if i != 3 and c[1]["value"]} == \
        {i: c for i, (c, _) in written.items() if c[1]["value"]}
    distill_mod.main(argv(tiny, data_file, out, e.url, extra=skip))  # resumes: only conversation 3 is asked again
    summary = summary_of(capsys)
    assert summary["already_done"] == 7 and summary["refused"] == 1 and summary["written"] == 0


def test_refusals_returning_before_answers_do_not_stop_the_run(tmp_path, tiny, engine, capsys):
    """Refusals come back at once while an answer holds its slot: 9 refused first requests of 12, all 12 in flight,
    finish before any answer; the rule waits for a pool's worth (12 slots) and the run goes on."""
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"turns": [("refuse me " if i < 9 else "") + f"the river {i}"]})
                              for i in range(12)) + "\n")
    e = engine(refuse_text="refuse me")
    out = tmp_path / "d.jsonl"
    capsys.readouterr()
    distill_mod.main(argv(tiny, data, out, e.url, extra=["--skip_verifier_check", "--in_flight", "12"]))
    summary = summary_of(capsys)
    assert summary["refused"] == 9 and summary["rows"] == 3 and summary["written"] == 3


@pytest.mark.parametrize("layout", ["vllm", "llama"])
def test_chat_completions_after_the_template_check(tmp_path, tiny, data_file, engine, local_rows, capsys, layout):
    """vLLM renders the chat in /tokenize; llama-server through /apply-template + /tokenize (its /tokenize answers a
    messages body with no tokens, which must not pass for a rendering)."""
    e = engine(layout=layout)
    out = tmp_path / "d.jsonl"
    capsys.readouterr()
    distill_mod.main(argv(tiny, data_file, out, e.url, extra=["--chat_completions"]))
    summary = summary_of(capsys)
    assert summary["served"]["chat_template_check"][e.url]["equal"] is True
    assert conversations(out) == conversations(local_rows)

    other_template = tiny[1].tokenizer.chat_template.replace("{{", "SYSTEM NOTE {{", 1)
    bad = engine(template=other_template, layout=layout)
    out2 = tmp_path / "d2.jsonl"
    with pytest.raises(SystemExit):
        distill_mod.main(argv(tiny, data_file, out2, bad.url, extra=["--chat_completions"]))
    err = capsys.readouterr().err
    assert "renders a chat with another template than the verifier's" in err and "part from ours at token" in err
    assert not out2.exists()


def test_block_size_counts_truncation_and_warns(tmp_path, tiny, data_file, engine, capsys):
    e = engine()
    out = tmp_path / "d.jsonl"
    distill_mod.main(argv(tiny, data_file, out, e.url, extra=["--block_size", "4096"]))
    summary = summary_of(capsys)
    assert summary["truncation"]["rows"] == 8 and summary["truncation"]["rows_cut"] == 0
    assert summary["truncation_warning"] is None
    tok = tiny[1].tokenizer
    from spectrain.data.chat import to_messages

    lengths = sorted(len(tok(tok.apply_chat_template(to_messages(r), tokenize=False), add_special_tokens=False)
                         ["input_ids"]) for r in rows_of(out))
    block = lengths[len(lengths) // 2]  # about half the conversations are longer
    distill_mod.main(argv(tiny, data_file, out, e.url, extra=["--block_size", str(block)]))  # resumes: all there
    captured = capsys.readouterr().out
    summary = json.loads(open(captured.strip().splitlines()[-1]).read())
    cut = sum(n > block for n in lengths)
    assert summary["written"] == 0 and summary["truncation"]["rows_cut"] == cut > 0
    assert 0 < summary["truncation"]["loss_tokens_cut"] <= summary["truncation"]["loss_tokens"]
    assert "warning: distilled conversations at --block_size" in captured and summary["truncation_warning"]


def test_parse_and_parting_logic():
    vllm = {"choices": [{"text": " a", "token_ids": [5, 6], "logprobs": {
        "tokens": ["token_id:5", "token_id:6"], "top_logprobs": [{"token_id:5": -0.1, "token_id:9": -2.6}, {}]}}]}
    c = parse_completion("u", "/v1/completions", vllm)
    assert c.token_ids == [5, 6] and c.margin(0) == pytest.approx(2.5) and c.margin(1) is None
    llama = {"choices": [{"text": "x", "logprobs": {"content": [
        {"id": 7, "logprob": -0.2, "top_logprobs": [{"id": 8, "logprob": -0.9}, {"id": 7, "logprob": -0.2}]}]}}]}
    c = parse_completion("u", "/v1/completions", llama)
    assert c.token_ids == [7] and c.margin(0) == pytest.approx(0.7)
    with pytest.raises(SpectrainError, match="token_ids is not a list"):
        parse_completion("u", "/v1/completions", {"choices": [{"text": "", "token_ids": "12"}]})
    p = first_parting([1, 2, 3], [5.0, 0.01, 4.0], [1, 4], Completion("", None).margin)
    assert p == Parting(1, 2, 4, 0.01, None) and p.near_tie(0.02) and not p.near_tie(0.005)
    assert first_parting([1, 2], [1, 1], [1, 2], lambda j: None) is None
    assert first_parting([1], [3.0, 0.5], [1, 9], lambda j: 0.1).local_id is None  # local stopped at 1
    # the kernel spread: the largest margin at which an engine parts from itself; None entries (no parting) ignored
    engine_self = [Parting(3, None, 7, None, 0.004), None, Parting(9, None, 2, None, 0.0011), Parting(1, None, 3, None, None)]
    assert kernel_spread(engine_self) == 0.004 and kernel_spread([None]) == 0.0
    assert Parting(0, 1, 2, 0.2, 0.25).near_tie(0.3) and not Parting(0, 1, 2, 0.2, 1.5).near_tie(0.3)
    assert not Parting(0, None, 2, None, 0.1).near_tie(0.3)  # the local margin unknown: not a near-tie
    assert median_range([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0, "runs": [3.0, 1.0, 2.0, 10.0]}


def test_endpoint_refused_connection_is_down_after_retries():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: nothing listens there
    endpoint = Endpoint(f"http://127.0.0.1:{port}/v1", retries=1, backoff=0)
    assert endpoint.url == f"http://127.0.0.1:{port}"
    with pytest.raises(EndpointDown, match="after 2 tries"):
        endpoint.models()


def test_benchmark_logic(tmp_path):
    """benchmarks/distill_engines.py's distill arguments (spectrain.data.distill_compare; its engine runs cannot run
    in tests)."""
    from spectrain.data.distill_compare import Comparison, distill_args

    c = Comparison("bundled:smollm2", ("example_data/alpaca_en_demo.json",), limit=32, max_new_tokens=64,
                   batch_size=32)
    stale = tmp_path / "o.jsonl"
    stale.write_text("{}\n")  # an earlier run's output would be resumed, not timed: removed
    args = distill_args(c, stale, "http://x:1", 8, skip_verifier_check=True)
    assert not stale.exists() and args.batch_size == 32 and args.skip_verifier_check
    assert args.server == ["http://x:1"] and args.in_flight == 8 and args.out == str(stale)
    assert vars(args).keys() == vars(distill_mod.parse_args([])).keys()  # spectrain-distill's own settings, no other
    local = distill_args(c, stale)
    assert local.server is None and local.max_turns == 1 and local.dtype == "float32"
    with pytest.raises(SpectrainError, match=r"spectrain-distill has no setting \['no_such'\]"):
        distill_args(c, stale, no_such=1)


def test_benchmark_reads_each_reply_back(tmp_path):
    """distill_engines.py compares replies by (conversation id, turn), the assistant turns in order."""
    from spectrain.data.distill_compare import replies_of

    out = tmp_path / "o.jsonl"
    turns = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}, {"from": "human", "value": "q2"},
             {"from": "gpt", "value": "b"}]
    out.write_text(json.dumps({"id": 3, "conversations": turns}) + "\n\n")
    assert replies_of(out) == {(3, 0): "a", (3, 1): "b"}
