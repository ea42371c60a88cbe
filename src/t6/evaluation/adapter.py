"""The lm-evaluation-harness model `t6`: scores requests with an in-memory T6 (no conversion).

    lm = T6LM(model=t6, tokenizer=tok)       # a live model and its tokenizer (the training callback)
    lm = T6LM(checkpoint="last.ckpt")        # a checkpoint, with the tokenizer it records (the lm_eval CLI)

Log-likelihood requests are left-truncated to the model's block size and split into the
prefix the model reads before the continuation and the continuation's own positions. Requests
with the same prefix (the choices of a multiple-choice item) share one prefill: the prefixes of
a batch go through the model once, left-padded, filling KV caches whose rows are then repeated
for each continuation (`KVCache.select`), and only the continuations run on top. Attentions
without padding masks batch prefixes of one length only. With share_prefix=False each request
runs whole, right-padded, sorted longest first (the per-choice path, kept as the reference).
Either way the LM head is applied only at the positions that score a continuation token, which
is most of the saving on a small model with a 50k vocabulary. Generation is greedy through
`T6.generate` (KV cache; on CUDA its fixed-shape decode step, replayed as a CUDA graph).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from t6.data.tokenizer import Tokenizer, gpt2, load_with_tokenizer
from t6.errors import SettingError
from t6.model import T6, fallback

AUTO_CPU_ROWS = 16  # batch_size=auto on the CPU, and on CUDA where the memory probe fails (t6.model.fallback)
AUTO_MEMORY_SHARE = 0.8  # of the memory left, for an evaluation's batch on CUDA
AUTO_MAX_ROWS = 256  # more rows per pass buys little: requests share passes by prefix and length
AUTO_PROBE_ROWS, AUTO_PROBE_TOKENS = 4, 32  # the measured probe batch: full-length requests, the last tokens scored


def rows_that_fit(available: float, per_row: float) -> int:
    """Rows of per_row bytes that AUTO_MEMORY_SHARE of available bytes hold, between 1 and AUTO_MAX_ROWS."""
    return int(max(1, min(AUTO_MAX_ROWS, AUTO_MEMORY_SHARE * available // max(per_row, 1))))


@register_model("t6")
class T6LM(TemplateLM):
    def __init__(
        self,
        model: T6 | None = None,
        checkpoint: str | None = None,
        batch_size: int | str | None = 16,
        device: str | None = None,
        max_gen_toks: int = 64,
        share_prefix: bool = True,
        tokenizer: Tokenizer | None = None,
        **kwargs,
    ):
        """model: a T6 to evaluate as it is (with its tokenizer, default GPT-2), or checkpoint: a checkpoint to
        load (with the tokenizer it records).
        batch_size: sequences per forward pass: requests, or with share_prefix the continuations that run
        together on their prefilled contexts; "auto" (and None, and lm-eval's auto:N) picks it from the
        device's memory (`auto_batch_size`).
        share_prefix: prefill a context once for all its continuations (False: once per request)."""
        super().__init__()
        if device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
            device = "cpu"  # lm_eval's CLI passes --device cuda by default
        if (model is None) == (checkpoint is None):
            raise SettingError(
                "give the t6 model exactly one of model= or checkpoint= (e.g. --model_args checkpoint=PATH)"
            )
        if model is None:
            model, tokenizer = load_with_tokenizer(
                checkpoint, what="checkpoint", device=device or ("cuda" if torch.cuda.is_available() else "cpu")
            )
        self.model = model
        self.tokenizer = tokenizer or gpt2()
        self.eot = self.tokenizer.eot
        self.model_device = next(model.parameters()).device if device is None else torch.device(device)
        self.model.to(self.model_device)
        self.block_size = model.cfg.block_size
        self.max_gen_toks = int(max_gen_toks)
        if not isinstance(share_prefix, bool):
            raise SettingError(
                f"share_prefix={share_prefix!r} must be true or false (e.g. --model_args share_prefix=false)"
            )
        self.share_prefix = share_prefix
        self.padding_masks = all(block.attn.supports_key_mask for block in model.blocks)
        # lm_eval's --batch_size: N, auto or auto:N (its re-search count, which one measurement makes moot)
        self.batch_size = (
            self.auto_batch_size() if batch_size is None or str(batch_size).startswith("auto") else int(batch_size)
        )

    @property
    def device(self) -> torch.device:
        """The device the model runs on: what lm-eval's LM reads through this property."""
        return self.model_device

    def auto_batch_size(self) -> int:
        """batch_size=auto. On CUDA: the rows that AUTO_MEMORY_SHARE of the memory left (free, plus what the
        caching allocator holds unused) holds, at most AUTO_MAX_ROWS (`probe_batch_size`); where the probe fails
        (t6.model.fallback "eval_batch_probe"), AUTO_CPU_ROWS. Elsewhere AUTO_CPU_ROWS: on the CPU a larger batch buys
        nothing, the cores are busy at 16."""
        if self.model_device.type != "cuda":
            return AUTO_CPU_ROWS
        if fallback.enabled("eval_batch_probe"):
            try:
                return self.probe_batch_size()
            except Exception as err:
                fallback.fell_back("eval_batch_probe", err)
        return AUTO_CPU_ROWS

    def probe_batch_size(self) -> int:
        """The CUDA memory probe: each row's memory measured as the peak of one scoring pass over a probe batch of
        AUTO_PROBE_ROWS full-length requests (their prefixes prefilled into KV caches, the last AUTO_PROBE_TOKENS
        tokens scored) under the caller's autocast, as evaluation will run."""
        device = self.model_device
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        prefix = [self.eot] * (self.block_size - AUTO_PROBE_TOKENS)
        probe = [[(None, prefix, [self.eot] * AUTO_PROBE_TOKENS)] for _ in range(AUTO_PROBE_ROWS)]  # one group each
        with torch.no_grad():
            self._score_shared(probe)
        torch.cuda.synchronize(device)
        per_row = (torch.cuda.max_memory_allocated(device) - before) / AUTO_PROBE_ROWS
        free, _ = torch.cuda.mem_get_info(device)
        unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return rows_that_fit(free + unused, per_row)

    # -- tokenizer ------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.eot

    @property
    def prefix_token_id(self) -> int:
        """What an empty context starts from: the tokenizer's BOS where it has one, else end-of-text (as
        lm-eval's `hf` model does)."""
        bos = getattr(self.tokenizer, "bos", None)
        return self.eot if bos is None else bos

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode_special(string)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    # -- scoring --------------------------------------------------------------------
    def _hidden(self, idx: torch.Tensor, start_pos: int = 0, caches: list | None = None) -> torch.Tensor:
        """idx [B, T] at positions start_pos.. -> final-norm hidden states [B, T, d]: T6.forward
        without the LM head (caches: the model's KV caches, read and extended). The blocks run eager
        even in a model compiled for training (T6.compile_blocks): every batch has its own shape."""
        m = self.model
        pos = torch.arange(start_pos, start_pos + idx.shape[1], device=idx.device)  # [T]
        x = m.embed(idx)  # [B, T, d]
        for i, block in enumerate(m.blocks):
            x = block.layers(x, pos, None if caches is None else caches[i])  # [B, T, d], never compiled
        return m.norm(x)  # [B, T, d]

    def _prefill(self, idx: torch.Tensor, caches: list) -> None:
        """Write idx [G, P] (positions 0..P-1) into the KV caches. Nothing reads the last block's
        output at these positions, so that block runs its attention only, which fills its cache."""
        m = self.model
        pos = torch.arange(idx.shape[1], device=idx.device)  # [P]
        x = m.embed(idx)  # [G, P, d]
        for block, cache in zip(m.blocks[:-1], caches[:-1]):
            x = block(x, pos, cache)  # [G, P, d]
        m.blocks[-1].attn(m.blocks[-1].attn_norm(x), pos, caches[-1])

    def _split(self, ctx: list[int], cont: list[int]) -> tuple[tuple[int, ...], list[int]]:
        """A request's model input, left-truncated to block_size: (prefix, tail). The model reads
        prefix + tail; its outputs at the len(cont) tail positions score the continuation."""
        inputs = (ctx + cont)[-(self.block_size + 1) : -1]  # every token but the last
        return tuple(inputs[: len(inputs) - len(cont)]), inputs[len(inputs) - len(cont) :]

    def _scores(self, hidden: torch.Tensor, starts: list[int], conts: list[list[int]]) -> list[tuple[float, bool]]:
        """hidden [B, T, d]; row i scores conts[i] from its positions starts[i].. -> [(logprob, is_greedy)]."""
        # N = all continuation tokens of the batch
        rows = torch.cat([torch.full((len(c),), i) for i, c in enumerate(conts)]).to(self.model_device)  # [N]
        cols = torch.cat([torch.arange(s, s + len(c)) for s, c in zip(starts, conts)]).to(self.model_device)  # [N]
        logprobs = F.log_softmax(self.model.lm_head(hidden[rows, cols]).float(), dim=-1)  # [N, vocab]
        targets = torch.tensor([t for c in conts for t in c], device=self.model_device)  # [N]
        token_lp = logprobs.gather(-1, targets[:, None]).squeeze(-1)  # [N]
        greedy = logprobs.argmax(-1) == targets  # [N]
        ends = torch.tensor([len(c) for c in conts]).cumsum(0).tolist()
        return [
            (float(token_lp[e - len(c) : e].sum()), bool(greedy[e - len(c) : e].all())) for e, c in zip(ends, conts)
        ]

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: [((context, continuation), context_tokens, continuation_tokens)] -> [(logprob, is_greedy)],
        in the order of the requests; each answer also goes to lm-eval's cache hook under its request key."""
        for _, ctx, cont in requests:
            if not ctx:
                raise ValueError(
                    "a log-likelihood request needs at least one context token (lm-eval gives an empty "
                    "context the end-of-text token)"
                )
            if not 0 < len(cont) <= self.block_size:
                raise ValueError(
                    f"a continuation of {len(cont)} tokens cannot be scored with block_size {self.block_size}"
                )
        batches = self._prefix_batches(requests) if self.share_prefix else self._request_batches(requests)
        score = self._score_shared if self.share_prefix else self._score_each
        results = [None] * len(requests)
        progress = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="t6 loglikelihood")
        for batch in batches:  # a batch: lists of request indices (one list per prefix, or one index each)
            members = [i for group in batch for i in group]
            for i, answer in zip(members, score([[requests[i] for i in group] for group in batch])):
                results[i] = answer
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
            progress.update(len(members))
        progress.close()
        return results

    # the per-choice path: each request whole -------------------------------------------
    def _request_batches(self, requests) -> list[list[list[int]]]:
        """Batches of batch_size requests (a group of one each), longest first."""

        def longest_first(i: int):
            tokens = requests[i][1] + requests[i][2]
            return -len(tokens), tuple(tokens)

        order = sorted(range(len(requests)), key=longest_first)
        return [[[i] for i in order[k : k + self.batch_size]] for k in range(0, len(order), self.batch_size)]

    def _score_each(self, batch) -> list[tuple[float, bool]]:
        """batch: groups of one request each -> their answers; every request runs whole, right-padded."""
        requests = [request for (request,) in batch]
        inputs = [list(prefix) + tail for prefix, tail in (self._split(ctx, cont) for _, ctx, cont in requests)]
        conts = [cont for _, _, cont in requests]
        idx = torch.full(
            (len(inputs), max(map(len, inputs))), self.eot, dtype=torch.long, device=self.model_device
        )  # [B, T]
        for i, x in enumerate(inputs):
            idx[i, : len(x)] = torch.tensor(x, dtype=torch.long)
        return self._scores(self._hidden(idx), [len(x) - len(c) for x, c in zip(inputs, conts)], conts)

    # the shared-prefix path: one prefill per context -------------------------------------
    def _prefix_batches(self, requests) -> list[list[list[int]]]:
        """Requests grouped by prefix (at most batch_size in a group), longest prefix first, in batches
        of at most batch_size requests that fit the block when left-padded (longest prefix + longest
        continuation) and, for an attention without padding masks, have one prefix length."""
        by_prefix: dict[tuple[int, ...], list[int]] = {}
        for i, (_, ctx, cont) in enumerate(requests):
            by_prefix.setdefault(self._split(ctx, cont)[0], []).append(i)
        groups = sorted(
            (
                (prefix, members[k : k + self.batch_size])
                for prefix, members in by_prefix.items()
                for k in range(0, len(members), self.batch_size)
            ),
            key=lambda g: (-len(g[0]), g[0]),
        )
        batches, rows, longest_prefix, longest_tail = [], 0, 0, 0
        for prefix, members in groups:
            tail = max(len(requests[i][2]) for i in members)
            joins = (
                bool(batches)
                and rows + len(members) <= self.batch_size
                and longest_prefix + max(longest_tail, tail) <= self.block_size
                and (self.padding_masks or len(prefix) == longest_prefix)
            )
            if joins:
                batches[-1].append(members)
                rows, longest_tail = rows + len(members), max(longest_tail, tail)
            else:
                batches.append([members])
                rows, longest_prefix, longest_tail = len(members), len(prefix), tail
        return batches

    def _score_shared(self, batch) -> list[tuple[float, bool]]:
        """batch: groups of requests with one prefix each -> their answers, group by group. The G prefixes
        run once, left-padded to the longest (the padding masked out), filling the KV caches; each cache
        row is then repeated for its group's continuations, which run right-padded after the prefixes."""
        prefixes = [self._split(group[0][1], group[0][2])[0] for group in batch]
        tails = [self._split(ctx, cont)[1] for group in batch for _, ctx, cont in group]
        conts = [cont for group in batch for _, _, cont in group]
        P, T = max(map(len, prefixes)), max(map(len, tails))
        caches = self.model.build_kv_caches(len(batch), P + T)
        if any(len(prefix) < P for prefix in prefixes):
            key_mask = torch.ones(len(batch), P + T, dtype=torch.bool, device=self.model_device)  # [G, P + T]
            for i, prefix in enumerate(prefixes):
                key_mask[i, : P - len(prefix)] = False  # the left padding
            for cache in caches:
                cache.key_mask = key_mask
        if P > 0:
            idx = torch.full(
                (len(batch), P), self.eot, dtype=torch.long, device=self.model_device
            )  # [G, P], left-padded
            for i, prefix in enumerate(prefixes):
                idx[i, P - len(prefix) :] = torch.tensor(prefix, dtype=torch.long)
            self._prefill(idx, caches)
        owner = torch.tensor([g for g, group in enumerate(batch) for _ in group], device=self.model_device)  # [R]
        caches = [cache.select(owner) for cache in caches]  # each prefix's rows once per continuation
        idx = torch.full((len(tails), T), self.eot, dtype=torch.long, device=self.model_device)  # [R, T], right-padded
        for i, tail in enumerate(tails):
            idx[i, : len(tail)] = torch.tensor(tail, dtype=torch.long)
        return self._scores(self._hidden(idx, P, caches), [0] * len(tails), conts)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-string log-likelihood in disjoint windows of block_size tokens (perplexity tasks)."""
        windows, owners = [], []
        for i, req in enumerate(requests):
            tokens = self.tok_encode(req.args[0])
            for ctx, cont in map(
                make_disjoint_window,
                get_rolling_token_windows(tokens, self.prefix_token_id, self.block_size, context_len=1),
            ):
                windows.append((None, ctx, cont))
                owners.append(i)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for i, (lp, _) in zip(owners, scores):
            totals[i] += lp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuation of each context, cut at the first stop string (`until`) or max_gen_toks."""
        outputs = []
        for req in tqdm(requests, disable=disable_tqdm or self.rank != 0, desc="t6 generate"):
            context, gen_kwargs = req.args
            gen_kwargs = dict(gen_kwargs or {})
            until = gen_kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = min(int(gen_kwargs.pop("max_gen_toks", self.max_gen_toks)), self.block_size - 1)
            # Stop strings that are one token stop decoding early; all of them cut the text below.
            stop_tokens = {self.eot} | {t[0] for t in map(self.tok_encode, until) if len(t) == 1}
            ctx = self.tok_encode(context)[-(self.block_size - max_new) :] or [self.prefix_token_id]
            idx = torch.tensor([ctx], dtype=torch.long, device=self.model_device)  # [1, T0]
            out = self.model.generate(idx, max_new, temperature=0.0, stop_tokens=tuple(sorted(stop_tokens)))
            new = out[0, len(ctx) :].tolist()
            if self.eot in new:
                new = new[: new.index(self.eot)]
            text = self.tok_decode(new)
            for stop in until:
                if stop and stop in text:
                    text = text[: text.index(stop)]
            outputs.append(text)
            self.cache_hook.add_partial("generate_until", (context, req.args[1]), text)
        return outputs
