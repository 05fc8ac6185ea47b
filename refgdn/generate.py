"""``python -m refgdn.generate``: plain and MTP speculative generation with one model, side by side.

    python -m refgdn.generate --preset tiny --ops refgdn --draft-steps 3 --max-new-tokens 32
    python -m refgdn.generate --checkpoint DIR --ops fast --device cuda --dtype bfloat16 \\
        --prompt-ids "1,2,3;4,5" --temperature 0.8 --draft-steps 2

Prints, per mode, the generated tokens of every request, tokens/s (prefill included; on a GPU the first
run also compiles the kernels: use --warmup), and for speculative decoding the acceptance rate (accepted /
proposed drafts), the mean accepted length per round (tokens emitted per request per round, bonus
included) and its histogram. With --temperature 0 it also says whether speculative == plain (it must).
A progress bar goes to stderr.

Random weights (--preset) give an MTP head that almost never agrees with the target; --draft-friendly MIX
derives the MTP head from the target (conformance.cases_model.draft_friendly_state: scaled-down layers,
identity MTP fc) so rounds show partial acceptance.
"""
from __future__ import annotations

import argparse
import sys
import time

DTYPES = {"float64": "float64", "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


class ProgressBar:
    """A plain progress bar on stderr (redrawn in place on a terminal, a few lines otherwise)."""

    def __init__(self, total: int, label: str, stream=None, width: int = 30):
        self.total, self.label, self.width = max(total, 1), label, width
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.done, self.t0, self._last = 0, time.perf_counter(), -1

    def __call__(self, n: int) -> None:
        self.done += n
        frac = min(self.done / self.total, 1.0)
        fill = int(frac * self.width)
        dt = time.perf_counter() - self.t0
        text = (f"{self.label} [{'#' * fill}{'.' * (self.width - fill)}] {self.done}/{self.total} tokens "
                f"{dt:6.1f}s {self.done / max(dt, 1e-9):8.1f} tok/s")
        if self.tty:
            self.stream.write("\r" + text)
        elif int(frac * 4) != self._last:
            self._last = int(frac * 4)
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def parse_prompts(text: str):
    """ "1,2,3;4,5" (or one prompt per line, ids separated by commas or spaces) -> [[1, 2, 3], [4, 5]]."""
    out = []
    for part in text.replace("\n", ";").split(";"):
        ids = [int(t) for t in part.replace(",", " ").split()]
        if ids:
            out.append(ids)
    if not out:
        raise ValueError("no prompt token ids given")
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m refgdn.generate", description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", metavar="DIR", help="config.json + *.safetensors (Hugging Face names)")
    src.add_argument("--preset", default=None, help="random weights of a config preset (tiny, bench); default tiny")
    ap.add_argument("--model-type", choices=["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"], default=None,
                    help="presets: the model family (default qwen3_next; qwen3_5_text: Qwen3.5's GDN projections, "
                         "dense MLPs; qwen3_5_moe_text: every MLP routed)")
    ap.add_argument("--ops", choices=["refgdn", "fast"], default="refgdn")
    ap.add_argument("--draft-steps", type=int, default=3, metavar="K", help="MTP draft steps per round (0: plain only)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sampling / rejection sampling")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--eos-token-id", type=int, default=None)
    pr = ap.add_mutually_exclusive_group()
    pr.add_argument("--prompt-ids", metavar='"1,2,3;4,5"', help="prompts as token ids; ';' separates prompts")
    pr.add_argument("--prompt-file", metavar="PATH", help="one prompt per line, token ids separated by , or spaces")
    ap.add_argument("--random-prompts", type=int, default=2, metavar="N",
                    help="without --prompt-ids/--prompt-file: N random prompts of lengths 3..16 (default 2)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="model dtype (default: bfloat16 on cuda, float32 on cpu; float64 only with refgdn)")
    ap.add_argument("--state-dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="GDN ssm state (default float32; vLLM serves with the model's dtype, e.g. bfloat16)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--seed", type=int, default=0, help="weights (presets), random prompts and sampling")
    ap.add_argument("--draft-friendly", type=float, default=None, metavar="MIX",
                    help="random presets: derive the MTP head from the target (MIX ~ 0.2: more agreement)")
    ap.add_argument("--warmup", action="store_true", help="run each mode once first (kernel compilation)")
    ap.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                    help="decode / verify / draft steps as CUDA graphs (fast.graphs; default: on for --ops fast on "
                         "cuda; --no-cuda-graphs runs the same steps eagerly)")
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def build_model(args, torch):
    from .model import Qwen3NextConfig, Qwen3NextModel
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.startswith("cuda") else "float32"))
    if args.checkpoint:
        return Qwen3NextModel.from_pretrained(args.checkpoint, ops=args.ops, dtype=dtype, device=device)
    cfg = Qwen3NextConfig.preset(args.preset or "tiny", model_type=args.model_type or "qwen3_next")
    if args.draft_friendly is not None:
        from conformance.cases_model import draft_friendly_state, model_from_state
        return model_from_state(cfg, draft_friendly_state(cfg, args.seed, args.draft_friendly), args.ops, dtype,
                                device)
    return Qwen3NextModel(cfg, ops=args.ops, dtype=dtype, device=device, seed=args.seed)


def state_dtype(args):
    """--state-dtype as a torch dtype (None: the model's default, float32)."""
    import torch
    return None if args.state_dtype is None else getattr(torch, args.state_dtype)


def cache_len(prompts, args) -> int:
    """Positions a request of this run can reach: its prompt, the new tokens and a round's drafts, with slack."""
    return max(len(p) for p in prompts) + args.max_new_tokens + 2 * max(args.draft_steps, 0) + 8


def graphed_steps(model, prompts, args):
    """The model's steps over fast.graphs (GraphedSteps): profile -> reserve -> warmup + capture, sized for
    this run (one padded batch size, verify graphs for k = 1..draft_steps, the draft-step graph)."""
    from fast.graphs import GraphedModel, GraphedSteps, profile_traffic
    from refgdn.capture import ServingConfig
    B = 1 << max(len(prompts) - 1, 0).bit_length()             # the padded batch size (a power of two)
    K = max(args.draft_steps, 0)
    max_len = cache_len(prompts, args)
    sdt = state_dtype(args)
    cfg = ServingConfig(capture_batch_sizes=(B,), max_draft=K, max_batch=B,
                        max_prefill_tokens=sum(len(p) for p in prompts), max_prefill_seqs=len(prompts),
                        state_dtype=sdt, device=str(model.device))
    model.check_values = False      # host value checks read device memory (a sync): graphs check on the device
    gm = GraphedModel(model, batch_sizes=(B,), max_draft=K, num_slots=B, max_len=max_len, state_dtype=sdt)
    gm.setup(profile=lambda: profile_traffic(model, cfg))
    return GraphedSteps(gm)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.ops == "fast" and args.dtype == "float64":
        print("--dtype float64 is for --ops refgdn (the fast kernels take float32 / bfloat16 / float16)", file=sys.stderr)
        return 2
    if args.cuda_graphs and args.ops != "fast":
        print("--cuda-graphs is for --ops fast (the refgdn oracle reads its inputs' values on the host to check "
              "them, which no graph can hold)", file=sys.stderr)
        return 2
    if args.model_type is not None and args.checkpoint:
        print("--model-type is for --preset (a checkpoint's config.json names its own family)", file=sys.stderr)
        return 2
    if args.ops == "fast":
        import fast  # noqa: F401  (sets TRITON_INTERPRET on a CPU-only machine before triton loads)
    import torch
    from .speculative import generate_plain, generate_speculative

    model = build_model(args, torch)
    V = model.config.vocab_size
    if args.prompt_ids:
        prompts = parse_prompts(args.prompt_ids)
    elif args.prompt_file:
        with open(args.prompt_file) as f:
            prompts = parse_prompts(f.read())
    else:
        gen = torch.Generator().manual_seed(args.seed)
        prompts = [torch.randint(0, V, (int(torch.randint(3, 17, (1,), generator=gen)),), generator=gen).tolist()
                   for _ in range(args.random_prompts)]
    print(f"model: {model.config.num_hidden_layers} layers, hidden {model.config.hidden_size}, vocab {V}, "
          f"ops={args.ops}, {model.dtype}, {model.device}; {len(prompts)} prompts of lengths "
          f"{[len(p) for p in prompts]}; max_new_tokens={args.max_new_tokens}, temperature={args.temperature}")
    common = dict(temperature=args.temperature, eos_token_id=args.eos_token_id, seed=args.seed)
    total = len(prompts) * args.max_new_tokens

    def run(label, fn):
        if args.warmup:
            fn(None)
        bar = None if args.no_progress else ProgressBar(total, label)
        res = fn(bar)
        if bar:
            bar.close()
        return res

    steps, cache_kw = model, {}
    use_graphs = args.cuda_graphs if args.cuda_graphs is not None else (args.ops == "fast"
                                                                        and model.device.type == "cuda")
    if use_graphs:
        steps = graphed_steps(model, prompts, args)
        cache_kw = dict(cache=steps.cache)
        print(f"CUDA graphs: batch sizes {steps._gm.batch_sizes}, verify k = 1..{steps._gm.max_draft}, "
              f"compilations per phase {dict(steps._gm.lc.real_compiles)}")
    elif args.state_dtype is not None:              # one cache in that state dtype for both runs
        cache_kw = dict(cache=model.allocate_cache(len(prompts), cache_len(prompts, args),
                                                   max_draft=max(args.draft_steps, 0), state_dtype=state_dtype(args)))
    if "cache" in cache_kw and cache_kw["cache"].gdn:
        print(f"GDN ssm state: {cache_kw['cache'].gdn[0].ssm_state.dtype}")

    plain = run("plain", lambda bar: generate_plain(steps, prompts, args.max_new_tokens, progress=bar, **common,
                                                    **cache_kw))
    results = [("plain", plain)]
    if args.draft_steps > 0:
        if not model.has_mtp:
            print("the model has no MTP head: speculative decoding skipped", file=sys.stderr)
        else:
            spec = run(f"speculative k={args.draft_steps}",
                       lambda bar: generate_speculative(steps, prompts, args.max_new_tokens, args.draft_steps,
                                                        progress=bar, **common, **cache_kw))
            results.append((f"speculative (k={args.draft_steps})", spec))
    for name, res in results:
        print(f"\n== {name}: {res.num_tokens} tokens in {res.seconds:.3f}s = {res.num_tokens / res.seconds:.1f} tok/s, "
              f"{res.steps} target steps after the prefill")
        for n, toks in enumerate(res.tokens):
            print(f"  [{n}] {toks}")
        if res.rounds:
            print(f"  rounds: {len(res.rounds)}; acceptance rate {res.acceptance_rate:.3f} "
                  f"(accepted / proposed drafts); mean accepted length per round {res.mean_accepted:.3f} tokens (bonus included)")
            print(f"  num_accepted histogram: {res.accept_histogram()}")
            print("  per round (num_accepted per request): "
                  + " ".join("[" + ",".join(map(str, r.num_accepted)) + "]" for r in res.rounds))
    if len(results) > 1 and args.temperature == 0:
        same = results[1][1].tokens == plain.tokens
        print(f"\ngreedy speculative == plain: {same}")
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
