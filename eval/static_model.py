"""The verifier (or a draft model) run over its HF weights with a preallocated KV cache.

HF's own cache classes differ between transformers releases and cannot drop the
rejected entries of a tree. This module runs the same weights over our own cache,
by one of two paths: a hand-written forward of the Llama-family decoder layer
(Llama, Mistral, Qwen2, Qwen3: ``path="llama"``), or the model's own decoder
layers through our cache, masks and attention function (any other family:
``path="layers"``, :mod:`spectrain.eval.native`). Either way:

* K/V live in buffers allocated once (per layer: kv_heads x max_len x head_dim);
* a forward writes its n new tokens at cache slots ``length .. length+n-1`` and
  attends through an explicit (n, max_len) boolean mask, so trees are verified
  with tree masks and depth-based positions;
* rollback is setting ``length``; accepted tree nodes are compacted with one
  ``index_copy_`` — nothing is reallocated;
* on CUDA every shape is static (attention spans ``max_len``), which is what a
  CUDA graph needs; in bf16/fp16 on a CPU shapes are static too, for
  batch-invariant decoding (a row's numbers independent of the forward's width:
  each row attends over a span set by its own slot, :meth:`StaticCausalLM.row_spans`);
  in fp32 on a CPU attention spans only the filled part.
* the hand-written layer's weights are prepared once per decoder
  (:mod:`spectrain.eval.llama_layer`: on a CPU fused and prepacked copies).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from spectrain.eval.attention import plan_attention
from spectrain.eval.llama_layer import decoder_weights, layer_forward
from spectrain.eval.native import LayerPath, unserved_reason
from spectrain.heads.errors import SpectrainError
from spectrain.heads.verifier import LogitTransform

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")  # the hand-written path's families
PATHS = ("auto", "llama", "layers")
ATTENTION_ROWS = 16  # query rows per attention call in batch-invariant decoding
# The widest matmul whose rows equal a 2-row call's, bit for bit: oneDNN's bf16 GEMM switches its blocking
# (and its reduction order) past 32 rows (measured on SmolLM2's shapes, torch 2.13, AMX: 33-41 rows on).
# Batch-invariant forwards wider than this run as consecutive sub-forwards of at most this many rows.
INVARIANT_ROWS = 32
SPAN_STEP = 32  # batch-invariant attention spans: a row's slot + 1 rounded up to this


class KVCache(nn.Module):
    """Preallocated keys and values: one buffer per layer and kind, each (1, kv_heads, max_len, head_dim).

    Separate buffers, not slices of one (layers, ...) tensor: under Inductor an in-place ``index_copy_`` into a
    slice of a larger buffer is functionalized into a copy of the whole base out and back, on every layer of
    every forward; into a buffer of its own it stays in place.
    """

    def __init__(self, num_layers: int, kv_heads: int, max_len: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (1, kv_heads, max_len, head_dim)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        for i in range(num_layers):
            for kind, bufs in (("k", self.k), ("v", self.v)):
                self.register_buffer(f"{kind}{i}", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
                bufs.append(getattr(self, f"{kind}{i}"))
        self.max_len = max_len
        # The rotary position of the token in each slot: what sliding windows are measured in (the model's own
        # layers path writes it at every forward; a committed slot's is its index once compacted).
        self.register_buffer("positions", torch.arange(max_len, device=device), persistent=False)

    def compact(self, src_slots: torch.Tensor, dst_start: int) -> None:
        """Move entries at ``src_slots`` (ascending) to ``dst_start, dst_start+1, ...``."""
        dst = torch.arange(dst_start, dst_start + src_slots.numel(), device=src_slots.device)
        for buf in self.k + self.v:
            buf.index_copy_(2, dst, buf.index_select(2, src_slots))
        self.positions.index_copy_(0, dst, self.positions.index_select(0, src_slots))


def default_batch_invariant(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Batch-invariant decoding by default: low precision on a CPU (where it was measured to give identity)."""
    return torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float16)


def binding_window(config, max_len: int) -> int | None:
    """The sliding window some layer of the model applies within ``max_len`` tokens, or None. Mistral's layers apply
    ``sliding_window`` whatever its ``layer_types`` say (its modeling never reads them)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types and config.model_type != "mistral":
        sliding = "sliding_attention" in types
    else:
        sliding = getattr(config, "use_sliding_window", True) is not False
    return window if window and sliding and window < max_len else None


def choose_path(config, max_len: int, path: str = "auto") -> str:
    """``llama`` (the hand-written layer) or ``layers`` (the model's own) for a model and a run's length."""
    if hasattr(config, "get_text_config") and config.get_text_config() is not config:
        raise SpectrainError(f"cannot decode {config.model_type!r}: a multimodal wrapper (its config nests a text "
                             "config); load the text model alone as the verifier (its *ForCausalLM class)")
    if path not in PATHS:
        raise SpectrainError(f"decoder path must be one of {', '.join(PATHS)}, not {path!r}")
    window = binding_window(config, max_len)
    llama_ok = config.model_type in SUPPORTED and window is None
    if path == "llama" and not llama_ok:
        why = (f"{config.model_type!r} is not one of {', '.join(SUPPORTED)}" if config.model_type not in SUPPORTED
               else f"its sliding window of {window} tokens is shorter than the {max_len} this run needs")
        raise SpectrainError(f"the hand-written Llama-family decoder cannot run this model: {why} "
                             "(--decoder layers runs the model's own layers)")
    if path == "auto":
        return "llama" if llama_ok else "layers"
    return path


class StaticCausalLM:
    """Forward of an HF causal LM over a :class:`KVCache`.

    ``length`` counts the committed tokens in the cache (host int: it changes
    once per decode round, after the round's single host sync). ``path``: ``auto`` (the hand-written
    Llama-family layer where it applies, else the model's own layers), ``llama`` or ``layers``.
    """

    def __init__(self, model, max_len: int, device: torch.device | str | None = None, static: bool | None = None,
                 batch_invariant: bool | None = None, path: str = "auto"):
        config = model.config
        self.path = choose_path(config, max_len, path)
        reason = unserved_reason(model) if self.path == "layers" else None
        if reason is not None:
            raise SpectrainError(f"cannot decode {config.model_type!r}: {reason}")
        limit = getattr(config, "max_position_embeddings", None)
        if limit and max_len > limit:
            raise SpectrainError(f"prompt + new tokens + draft need {max_len} positions but the model's context "
                                 f"is {limit}")
        self.model = model
        self.inner = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.lm_head = model.get_output_embeddings()
        self.logit_transform = LogitTransform.of(config)
        param = next(model.parameters())
        self.device = torch.device(device) if device is not None else param.device
        self.dtype = param.dtype
        attn = self.inner.layers[0].self_attn
        self.head_dim = getattr(attn, "head_dim", None) or getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)
        self.scaling = getattr(attn, "scaling", self.head_dim ** -0.5)
        self.kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        value_dim = getattr(config, "v_head_dim", None)
        if value_dim and value_dim != self.head_dim:
            raise SpectrainError(f"cannot decode {config.model_type!r}: its values are {value_dim} wide and its keys "
                                 f"{self.head_dim} (latent attention); the cache holds keys and values of one width")
        # Batch-invariant (a row's numbers do not depend on how many rows run beside it): what makes bf16
        # speculative output equal bf16 AR output token for token. It needs a fixed attention span (static
        # shapes) and attention in calls of a fixed row count (grouped_attention's ``rows``). Default: on for
        # low precision on a CPU, where it was measured; off on CUDA (untested there: cuBLAS and the fused
        # attention kernels choose by shape) and in fp32, where both paths agree without it.
        if batch_invariant is None:  # a caller that asks for dynamic shapes gets the plain path
            batch_invariant = default_batch_invariant(self.device, self.dtype) and static is not False
        if batch_invariant and static is False:
            raise SpectrainError("batch-invariant decoding needs static shapes (attention over the whole buffer)")
        self.batch_invariant = batch_invariant
        self.attention_rows = ATTENTION_ROWS if batch_invariant else None
        # A 1-row matmul takes a matrix-vector kernel whose reduction order differs from the 2+-row one (measured:
        # the down projection, 1 bf16 ulp): batch-invariant forwards run at least 2 rows (the second a padding row),
        # and at most INVARIANT_ROWS (a wider one runs as sub-forwards of that many rows).
        self.min_rows = 2 if batch_invariant else 1
        self.max_rows = INVARIANT_ROWS if batch_invariant else None
        # Static shapes (attention over the whole buffer, so a forward's shapes depend on n only): what a CUDA
        # graph, a compiled graph and batch-invariant decoding need. The default on CUDA and with batch_invariant.
        self.static = (self.device.type == "cuda" or batch_invariant) if static is None else static
        # Static runs pad a forward to a compiled size; the padding rows write one scratch slot past max_len.
        self.width = max_len + 1 if self.static else max_len
        self.cache = KVCache(len(self.inner.layers), self.kv_heads, self.width, self.head_dim, self.dtype, self.device)
        self.max_len = max_len
        # The model's own layers through our cache, masks and attention function (refused with the reason when
        # they cannot take them); None on the hand-written path.
        self.layers = LayerPath(model, self.cache, self.attention_rows) if self.path == "layers" else None
        # The hand-written layers' weights as their forward uses them (fused and packed copies on a CPU where
        # they fit: eval/llama_layer.py); None on the model's own layers.
        self.weights = decoder_weights(self.inner, self.lm_head, self.device) if self.layers is None else None
        self.groups = config.num_attention_heads // self.kv_heads  # query heads per KV head
        self.buckets: tuple[int, ...] = ()  # the compiled forward sizes (static runs; see compile())
        self._compiled = None
        self._padding: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.length = 0
        # HF hidden_states indices to keep from each forward in ``aux`` (n, len * H), for drafters that fuse layers.
        self.capture: tuple[int, ...] = ()
        self.aux: torch.Tensor | None = None

    # -- masks ------------------------------------------------------------------------------------------------
    def chain_mask(self, n: int) -> torch.Tensor:
        """(n, width): query i sees every committed slot and the new slots up to itself."""
        slots = torch.arange(self.width, device=self.device)
        return slots[None, :] <= self.length + torch.arange(n, device=self.device)[:, None]

    def tree_mask(self, ancestors: torch.Tensor) -> torch.Tensor:
        """(n, width) from an (n, n) ancestor-or-self matrix over the new tokens."""
        n = ancestors.shape[0]
        mask = torch.zeros(n, self.width, dtype=torch.bool, device=self.device)
        mask[:, :self.length] = True
        mask[:, self.length:self.length + n] = ancestors
        return mask

    # -- forward ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run n new tokens; write their K/V at slots ``length..length+n-1`` (``length`` is not advanced).

        Args:
            input_ids: (n,) token ids.
            positions: (n,) rotary positions (tree: ``length + depth``); default ``length + arange(n)``.
            mask: (n, width) bool, True = may attend; default causal over the chain.
        Returns:
            (n, H) final hidden states (after the final norm).
        """
        n = input_ids.shape[0]
        if self.length + n > self.max_len:
            raise SpectrainError(f"KV cache overflow: {self.length} + {n} tokens > max_len {self.max_len}")
        if self.layers is None:
            return self._forward(input_ids, positions, mask, n)
        with self.layers.active():  # our attention function on the model's layers while this forward runs
            return self._forward(input_ids, positions, mask, n)

    def _forward(self, input_ids, positions, mask, n):
        slots = torch.arange(self.length, self.length + n, device=self.device)
        if positions is None:
            positions = slots
        if mask is None:
            mask = self.chain_mask(n)
        if not self.static:
            span = self.length + n  # attend over the filled part only
            out, self.aux = self._forward_layers(input_ids, positions, mask[:, :span], slots, [(0, n, span)])
            return out
        if self.max_rows is None or n <= self.max_rows:
            return self._static_run(input_ids, positions, mask, slots, self.length)
        # Batch-invariant and wider than the matmuls stay invariant: consecutive sub-forwards. Each writes its
        # slots before attending, and a row's mask admits only earlier slots (its chain or tree ancestors) and
        # itself, so later sub-forwards see the K/V the earlier ones wrote: the same attention as one forward.
        outs, auxes = [], []
        for start in range(0, n, self.max_rows):
            part = slice(start, start + self.max_rows)
            outs.append(self._static_run(input_ids[part], positions[part], mask[part], slots[part],
                                         self.length + start))
            auxes.append(self.aux)
        self.aux = None if auxes[0] is None else torch.cat(auxes)
        return torch.cat(outs)

    def _static_run(self, input_ids, positions, mask, slots, first):
        """One static-shape forward of n rows at slots ``first..`` (padded to a compiled size, or to
        ``min_rows``): (n, H)."""
        n = input_ids.shape[0]
        size = self.bucket(n)
        if size is None and n < self.min_rows:  # batch-invariant: a 1-row forward runs as 2 rows, eagerly
            input_ids, positions, mask, slots = self._pad(self.min_rows - n, input_ids, positions, mask, slots)
            out, aux = self._forward_layers(input_ids, positions, mask, slots, self.row_spans(first, n, self.min_rows))
            self.aux = None if aux is None else aux[:n]
            return out[:n]
        if size is None:  # past every compiled size (a long prefill), or nothing compiled: eager, static shapes
            out, self.aux = self._forward_layers(input_ids, positions, mask, slots, self.row_spans(first, n, n))
            return out
        if size > n:
            input_ids, positions, mask, slots = self._pad(size - n, input_ids, positions, mask, slots)
        elif positions is slots:  # Dynamo guards on aliasing: one tensor as both would be a graph of its own
            positions = slots.clone()
        out, aux = self._compiled(input_ids, positions, mask, slots)
        # Clone: a CUDA graph's outputs are overwritten by its next replay (a fusing drafter reads aux after it).
        self.aux = None if aux is None else aux[:n].clone()
        return out[:n].clone()

    def row_spans(self, first: int, n: int, total: int) -> list[tuple[int, int, int]]:
        """The cache slots each row of a static forward attends over, as (start, stop, span) row ranges: the
        ``n`` rows at slots ``first..first+n-1`` and ``total - n`` padding rows after them (attending as the
        last row does).

        Batch-invariant on the hand-written layers, nothing compiled: a row at slot s attends over the first
        ``min(width, (s // SPAN_STEP + 1) * SPAN_STEP)`` slots — a function of its slot alone, so an AR step and
        the same row in a verify pass make the same attention call (the fused kernel's result depends on the
        span, not only on the slots the mask admits), and an AR step attends over about its context, not the
        whole buffer. Every row's mask admits no slot after its own (chains, tree ancestors, lookahead's window:
        what sub-forwards need too). Otherwise one range over the whole width.
        """
        if not self.batch_invariant or self._compiled is not None or self.layers is not None:
            return [(0, total, self.width)]
        ranges, row = [], 0
        while row < n:
            span = min(self.width, ((first + row) // SPAN_STEP + 1) * SPAN_STEP)
            ranges.append((row, min(n, span - first), span))  # the rows whose slots lie below span
            row = ranges[-1][1]
        ranges[-1] = (ranges[-1][0], total, ranges[-1][2])  # padding rows attend as the last row does
        return ranges

    def bucket(self, n: int) -> int | None:
        """The compiled size a forward of n tokens runs at: the smallest one >= n (None past them all)."""
        return next((b for b in self.buckets if b >= n), None)

    def _pad(self, extra: int, input_ids, positions, mask, slots):
        """Append ``extra`` padding rows: they write the scratch slot past ``max_len``, attend as the last row
        does, and are cut off."""
        if extra not in self._padding:
            self._padding[extra] = torch.full((extra,), self.max_len, device=self.device)
        last = slice(-1, None)
        return (torch.cat([input_ids, input_ids.new_zeros(extra)]),
                torch.cat([positions, positions[last].expand(extra)]),
                torch.cat([mask, mask[last].expand(extra, -1)]), torch.cat([slots, self._padding[extra]]))

    def _forward_layers(self, input_ids, positions, mask, slots, ranges):
        """The forward as a pure function of tensors (CUDA: one range over the whole width, so shapes depend on n
        only): (n, H) final hidden states and the captured layers (n, len(capture) * H), or None. ``ranges``:
        (start, stop, span) row ranges and the slots they attend over (:meth:`row_spans`)."""
        if self.layers is not None:
            return self.layers.forward(input_ids, positions, mask, slots, ranges[-1][2], self.capture)
        x = self.inner.embed_tokens(input_ids)[None]  # (1, n, H)
        cos, sin = self.inner.rotary_emb(x, positions[None])
        cos, sin = cos[:, None], sin[:, None]  # (1, 1, n, d)
        plan = plan_attention(mask, self.groups, self.attention_rows, ranges, self.dtype)  # once for every layer
        captured = []
        last = len(self.inner.layers)
        for i in range(last):
            x = layer_forward(self.weights, i, x, cos, sin, self.cache.k[i], self.cache.v[i], slots, plan,
                              self.head_dim, self.scaling)
            if i + 1 in self.capture and i + 1 < last:  # HF hidden_states[i+1]: the output of layer i
                captured.append(x[0])
        out = self.inner.norm(x)[0]
        if not self.capture:
            return out, None
        captured += [out] if last in self.capture else []  # hidden_states[N] is the final (normed) state in HF's
        return out, torch.cat(captured, -1)  # convention

    def compile(self, sizes, mode: str | None = "auto", backend="inductor") -> float:
        """Compile the forward for the sizes a run will use, warm every one up, and return the seconds that took
        (report it apart: never inside a timed region).

        ``sizes`` are the forwards' token counts: AR's 1, each drafter's ``max_nodes + 1``, the planner's. Each is
        one graph (``dynamic=False``, ``fullgraph=True``: a graph break is an error, not a silent eager piece); a
        forward of another size pads up to the next compiled one (a hybrid's merged branch, short prefills), and
        one past them all (a long prefill) runs eagerly with the same static shapes. ``mode="auto"``: CUDA graphs
        on CUDA (``reduce-overhead``), Inductor's default elsewhere. Needs a static runner (the CUDA default;
        ``static=True`` elsewhere).
        """
        if not self.static:
            raise SpectrainError("compile() needs static shapes: StaticCausalLM(..., static=True) (the CUDA default)")
        if self.length:
            raise SpectrainError("compile() warms up on an empty cache: call it before decoding")
        if self.weights is not None and self.weights.copied:  # Inductor takes the module's plain weights
            self.weights = decoder_weights(self.inner, self.lm_head, self.device, copy=False)
        cap = self.max_rows or self.max_len  # batch-invariant: a wider forward runs as sub-forwards of max_rows
        self.buckets = tuple(sorted({min(max(int(s), self.min_rows), cap) for s in sizes if 1 <= int(s) <= self.max_len}))
        if not self.buckets:
            raise SpectrainError("compile() needs at least one forward size in 1..max_len")
        if mode == "auto":
            mode = "reduce-overhead" if self.device.type == "cuda" else None
        options = {"mode": mode} if backend == "inductor" else {}  # another backend (a counter, in tests): as is
        import torch._dynamo.config as dynamo_config

        # One cache entry per bucket on this one code object (the default limit of 8 would send the rest to eager).
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 2 * len(self.buckets) + 8)
        dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit,
                                                        8 * len(self.buckets) + 64)
        self._compiled = torch.compile(self._static_forward, backend=backend, dynamic=False, fullgraph=True, **options)
        t0 = time.perf_counter()
        for size in self.buckets:
            ids = torch.zeros(size, dtype=torch.long, device=self.device)
            for _ in range(3):  # compile, then CUDA graph warm-up and capture
                self.forward(ids)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def _static_forward(self, input_ids, positions, mask, slots):
        return self._forward_layers(input_ids, positions, mask, slots, [(0, input_ids.shape[0], self.width)])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) -> (..., V) in fp32, as the model's head computes them (its family's :class:`LogitTransform`,
        in fp32); batch-invariant: rows in calls of 2 to ``max_rows``, like the layers' matmuls."""
        if self.max_rows is not None and hidden.dim() == 2:
            logits = torch.cat([self._head_rows(hidden[i:i + self.max_rows])
                                for i in range(0, hidden.shape[0], self.max_rows)])
        else:
            logits = self._head(hidden).float()
        return logits if self.logit_transform.identity else self.logit_transform(logits)

    def _head_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, H) -> (n, V) fp32 for 1 <= n <= max_rows, a single row run as 2 (batch-invariant)."""
        if hidden.shape[0] >= self.min_rows:
            return self._head(hidden).float()
        return self._head(torch.cat([hidden, hidden.new_zeros(1, hidden.shape[1])]))[:1].float()

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head's matmul (the hand-written path's copy of its weight, where it made one)."""
        if self.weights is None:
            return self.lm_head(hidden)
        return self.weights.linear(hidden, *self.weights.head)

    # -- cache bookkeeping ------------------------------------------------------------------------------------------
    def commit(self, n: int, src_slots: torch.Tensor | None = None) -> None:
        """Keep n of the tokens just run: the first n (chain), or those at ``src_slots`` (tree, compacted)."""
        if src_slots is not None:
            self.cache.compact(src_slots, self.length)
        self.length += n

    def reset(self) -> None:
        self.length = 0
