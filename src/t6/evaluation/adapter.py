"""The lm-evaluation-harness model `t6`: scores requests with an in-memory T6 (no conversion).

    lm = T6LM(model=t6)                      # a live model (the training callback)
    lm = T6LM(checkpoint="last.ckpt")        # a Lightning checkpoint (eval.py, the lm_eval CLI)

Log-likelihood requests are sorted by length (longest first), padded on the right into
batches, and left-truncated to the model's block size; the LM head is applied only at the
positions that score a continuation token, which is most of the saving on a small model
with a 50k vocabulary. Generation is greedy through `T6.generate` (KV cache).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from t6.data.tokenizer import EOT, gpt2_encoding
from t6.model import T6
from t6.model.load import load_model


@register_model("t6")
class T6LM(TemplateLM):
    def __init__(
        self,
        model: T6 | None = None,
        checkpoint: str | None = None,
        batch_size: int | str | None = 16,
        device: str | None = None,
        max_gen_toks: int = 64,
        **kwargs,
    ):
        """model: a T6 to evaluate as it is, or checkpoint: a training checkpoint to load.
        batch_size: sequences per forward pass ("auto" and None mean 16)."""
        super().__init__()
        if device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
            device = "cpu"  # lm_eval's CLI passes --device cuda by default
        if (model is None) == (checkpoint is None):
            raise ValueError("give the t6 model exactly one of model= or checkpoint= (e.g. --model_args checkpoint=PATH)")
        if model is None:
            model = load_model(checkpoint, "checkpoint", device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = model
        self._device = next(model.parameters()).device if device is None else torch.device(device)
        self.model.to(self._device)
        self.batch_size = 16 if batch_size in (None, "auto") else int(str(batch_size).split(":")[0])
        self.max_gen_toks = int(max_gen_toks)
        self.block_size = model.cfg.block_size
        self.enc = gpt2_encoding()

    # -- tokenizer ------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return EOT

    @property
    def tokenizer_name(self) -> str:
        return "gpt2"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.enc.encode(string, allowed_special={"<|endoftext|>"})

    def tok_decode(self, tokens: list[int]) -> str:
        return self.enc.decode(tokens)

    # -- scoring --------------------------------------------------------------------
    def _hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """idx [B, T] -> final-norm hidden states [B, T, d]: T6.forward without the LM head."""
        m = self.model
        pos = torch.arange(idx.shape[1], device=idx.device)  # [T]
        x = m.embed(idx)  # [B, T, d]
        for block in m.blocks:
            x = block(x, pos)  # [B, T, d]
        return m.norm(x)  # [B, T, d]

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: [((context, continuation), context_tokens, continuation_tokens)] -> [(logprob, is_greedy)]."""
        for _, _, cont in requests:
            if not 0 < len(cont) <= self.block_size:
                raise ValueError(f"a continuation of {len(cont)} tokens cannot be scored with block_size {self.block_size}")

        def sort_key(req):
            tokens = req[1] + req[2]
            return -len(tokens), tuple(tokens)

        collator = Collator(requests, sort_fn=sort_key)
        results = []
        progress = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="t6 loglikelihood")
        for batch in collator.get_batched(n=self.batch_size):
            inputs, conts = [], []
            for _, ctx, cont in batch:
                full = (ctx + cont)[-(self.block_size + 1):]  # left-truncate the context to fit
                inputs.append(full[:-1])  # the model reads every token but the last
                conts.append(cont)
            T = max(len(x) for x in inputs)
            idx = torch.full((len(inputs), T), EOT, dtype=torch.long, device=self._device)  # [B, T], right-padded
            for i, x in enumerate(inputs):
                idx[i, : len(x)] = torch.tensor(x, dtype=torch.long)
            hidden = self._hidden(idx)  # [B, T, d]
            rows = torch.cat([torch.full((len(c),), i) for i, c in enumerate(conts)]).to(self._device)  # [N] (N = all continuation tokens)
            cols = torch.cat([torch.arange(len(x) - len(c), len(x)) for x, c in zip(inputs, conts)]).to(self._device)  # [N]
            logprobs = F.log_softmax(self.model.lm_head(hidden[rows, cols]).float(), dim=-1)  # [N, vocab]
            targets = torch.tensor([t for c in conts for t in c], device=self._device)  # [N]
            token_lp = logprobs.gather(-1, targets[:, None]).squeeze(-1)  # [N]
            greedy = logprobs.argmax(-1) == targets  # [N]
            start = 0
            for (key, _, _), cont in zip(batch, conts):
                end = start + len(cont)
                answer = (float(token_lp[start:end].sum()), bool(greedy[start:end].all()))
                results.append(answer)
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
                start = end
            progress.update(len(batch))
        progress.close()
        return collator.get_original(results)

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
            stop_tokens = {EOT} | {t[0] for t in map(self.tok_encode, until) if len(t) == 1}
            ctx = self.tok_encode(context)[-(self.block_size - max_new):] or [EOT]
            idx = torch.tensor([ctx], dtype=torch.long, device=self._device)  # [1, T0]
            out = self.model.generate(idx, max_new, temperature=0.0, stop_tokens=tuple(sorted(stop_tokens)))
            new = out[0, len(ctx):].tolist()
            if EOT in new:
                new = new[: new.index(EOT)]
            text = self.tok_decode(new)
            for stop in until:
                if stop and stop in text:
                    text = text[: text.index(stop)]
            outputs.append(text)
            self.cache_hook.add_partial("generate_until", (context, req.args[1]), text)
        return outputs
