"""An OpenAI-compatible serving engine in-process, for tests: a stdlib HTTP server on 127.0.0.1 that answers
``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` and ``/tokenize`` from a local model (the tests of
``spectrain-distill --server`` and of docs/own-model.md's page, which stands it in for ``vllm serve``)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch


class FakeEngine:
    """An OpenAI-compatible server over a local model: greedy (T = 0) or seeded sampled completions of token-id or
    text prompts, vLLM's ``token_ids`` / ``"token_id:N"`` top log-probs, or llama-server's ``logprobs.content``.

    ``fault``: ``"bad_json"``, ``"missing_text"``, ``"http400"``, ``"http503"`` answer every completion so;
    ``die_after=N``: after N completion requests every request is dropped without an answer (a dead engine);
    ``template``: the chat template its ``/tokenize`` and chat route render with (default: the model's own);
    ``max_context=N``: a completion whose prompt plus ``max_tokens`` is past N tokens is refused (HTTP 400, vLLM's
    message); ``refuse_text``: a prompt containing this text is refused (HTTP 400)."""

    def __init__(self, verifier, *, name="tiny", layout="vllm", fault=None, die_after=None, template=None,
                 max_context=None, refuse_text=None):
        self.model, self.tokenizer = verifier.model, verifier.tokenizer
        self.name, self.layout, self.fault, self.die_after = name, layout, fault, die_after
        self.template, self.max_context, self.refuse_text = template, max_context, refuse_text
        self.lock, self.completions, self.prompts = threading.Lock(), 0, []
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                engine.route(self, "GET", None)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                engine.route(self, "POST", body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def send(self, handler, status: int, payload) -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def render(self, messages) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                  chat_template=self.template)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def route(self, handler, method: str, body) -> None:
        if method == "GET" and handler.path == "/v1/models":
            return self.send(handler, 200, {"object": "list", "data": [{"id": self.name, "object": "model"}]})
        if self.layout == "llama" and handler.path == "/tokenize":  # llama-server: text only; no "content", no tokens
            ids = self.tokenizer(body.get("content", ""), add_special_tokens=False)["input_ids"]
            return self.send(handler, 200, {"tokens": ids if "content" in body else []})
        if self.layout == "llama" and handler.path == "/apply-template":  # llama-server: the chat as its template's text
            text = self.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False,
                                                      chat_template=self.template)
            return self.send(handler, 200, {"prompt": text})
        if handler.path == "/tokenize" and "messages" in body:  # vLLM's chat form
            return self.send(handler, 200, {"tokens": self.render(body["messages"]), "count": 0})
        if handler.path not in ("/v1/completions", "/v1/chat/completions"):
            return self.send(handler, 404, {"error": {"message": f"no route {handler.path}"}})
        with self.lock:
            self.completions += 1
            dead = self.die_after is not None and self.completions > self.die_after
        if dead:
            handler.close_connection = True  # no answer at all: the client sees the connection drop
            return None
        if self.fault == "bad_json":
            return self.send(handler, 200, b'{"choices": [{"text": "trunc')
        if self.fault == "missing_text":
            return self.send(handler, 200, {"choices": [{"index": 0, "finish_reason": "stop"}]})
        if self.fault in ("http400", "http503"):
            code = int(self.fault[4:])
            return self.send(handler, code, {"error": {"message": f"engine says no ({code})", "code": code}})
        chat = handler.path.endswith("chat/completions")
        prompt = self.render(body["messages"]) if chat else body["prompt"]
        if isinstance(prompt, str):
            prompt = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if self.max_context and len(prompt) + body["max_tokens"] > self.max_context:
            return self.send(handler, 400, {"error": {"message": f"This model's maximum context length is "
                                                                 f"{self.max_context} tokens", "code": 400}})
        if self.refuse_text and self.refuse_text in self.tokenizer.decode(prompt):
            return self.send(handler, 400, {"error": {"message": "prompt refused by policy", "code": 400}})
        self.prompts.append(prompt)
        ids, tops = self.generate(prompt, body["max_tokens"], body["temperature"], body.get("seed"),
                                  body.get("top_logprobs") if chat else body.get("logprobs"))
        return self.send(handler, 200, self.answer(ids, tops, chat))

    @torch.no_grad()
    def generate(self, prompt, max_tokens, temperature, seed, top_k):
        out, tops = [], []
        generator = torch.Generator().manual_seed(seed or 0)
        for _ in range(max_tokens):
            logits = self.model(torch.tensor([prompt + out])).logits[0, -1].float()
            logprobs = torch.log_softmax(logits, -1)
            if temperature == 0:
                token = int(logits.argmax())
            else:
                token = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator))
            if top_k:
                values, indices = torch.topk(logprobs, top_k)
                tops.append([(int(i), float(v)) for i, v in zip(indices, values)])
            out.append(token)
            if token == self.tokenizer.eos_token_id:
                break
        return out, tops

    def answer(self, ids, tops, chat):
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        choice = {"index": 0, "finish_reason": "stop"}
        if self.layout == "vllm":  # token_ids (the EOS included) and "token_id:N" keys
            choice["token_ids"] = ids
            if tops:
                choice["logprobs"] = {"tokens": [f"token_id:{i}" for i in ids],
                                      "top_logprobs": [{f"token_id:{i}": v for i, v in top} for top in tops]}
        elif self.layout == "llama" and tops:  # ids only inside logprobs.content (EOS not listed)
            cut = [i for i in ids if i != self.tokenizer.eos_token_id]
            choice["logprobs"] = {"content": [
                {"id": i, "token": self.tokenizer.decode([i]), "logprob": top[0][1],
                 "top_logprobs": [{"id": j, "logprob": v} for j, v in top]} for i, top in zip(cut, tops)]}
        # layout "text": the text alone (TGI's completions return no ids)
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"object": "text_completion", "model": self.name, "choices": [choice]}
