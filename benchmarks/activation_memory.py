"""Activation memory of one training forward: every tensor autograd saves for the backward, by module, dtype, shape.

    python benchmarks/activation_memory.py                                   # every family, 340m, T = 512, CPU
    python benchmarks/activation_memory.py --families mamba2 gated_deltanet --size tiny --seq-len 256
    python benchmarks/activation_memory.py --dtype float32                   # fp32 forward, no autocast
    python benchmarks/activation_memory.py --families mamba2 model.mixer_kwargs.state_size=64   # Hydra overrides

For each family (conf/model/<family>.yaml at preset --size, random weights, benchmarks.decode.build) one training
forward, model(input_ids, labels=input_ids, return_logits=False).loss as train.py runs it (batch 1, --seq-len
tokens, on the CPU), runs under torch.autograd.graph.saved_tensors_hooks. Weights are fp32; --dtype autocast-bf16
(the default) runs the forward under torch.autocast("cpu", bfloat16) as training's bf16 autocast does on the GPU,
float32 / bfloat16 run without autocast with the weights in that dtype.

Every saved tensor is counted once per storage (untyped_storage().data_ptr(): views of one buffer count once, at
the storage's full size, since a saved view keeps its whole buffer alive) and attributed to the first save of
that storage: the module that was running (a module-path stack kept by forward pre/post hooks; layer indices
become *), the line of models/ code that saved it (or "kernel op" when a frame of hilo_kernels/ is on the stack: the
operators' own saved tensors), its dtype and its shape per token (the token dimension dropped; "T" where the
tokens are split into chunks). Saved parameters are not activations: they, and other saved tensors of a parameter's
shape (autocast's bf16 weight casts, the fused loss's LM-head gradient: per-step costs that do not grow with the
tokens), are reported apart from the per-token numbers.

The "kernel op" bucket on the CPU holds what the operators' torch backends (chunked PyTorch through autograd)
save; on CUDA the Triton backends' autograd.Functions save different tensors (their contiguous inputs and chunk
states), so that column does not carry over to the GPU; the shell columns (everything outside kernels/) do,
except that CPU and CUDA autocast may differ on a few op lists.

Reported per family: parameters, saved bytes per token (all, and per layer split into shell and kernel op), the
weight-shaped tensors saved once per step, and the top entries (module pattern, code line, dtype, shape per token)
by bytes per token per layer, the kernel op's as one entry per module unless --kernel-detail.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# run as a script, this folder is sys.path[0]: the repository's packages are imported from REPO, ahead of the rest
sys.path.insert(0, str(REPO))

from benchmarks.decode import FAMILIES, build

KERNELS_DIR = str(REPO / "hilo_kernels") + "/"
MODELS_DIR = str(REPO / "models") + "/"
KERNEL_OP = "kernel op"
DTYPES = ("autocast-bf16", "float32", "bfloat16")
LAYER_INDEX = re.compile(r"(?<=\blayers\.)\d+(?=\.|$)")


@dataclasses.dataclass
class Saved:
    """One storage saved for the backward: its first saver's module path, code site, dtype, shape, bytes."""

    module: str
    site: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    kind: str  # "activation", "parameter" (a parameter itself) or "weight-shaped" (a parameter's shape, not one)

    @property
    def pattern(self) -> str:
        return LAYER_INDEX.sub("*", self.module)

    @property
    def in_layer(self) -> bool:
        return LAYER_INDEX.search(self.module) is not None


def _site(frame) -> str:
    """KERNEL_OP when hilo_kernels/ code is on the stack, else the innermost models/ line (file:line), else '-'."""
    site = None
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(KERNELS_DIR):
            return KERNEL_OP
        if site is None and name.startswith(MODELS_DIR):
            site = f"{name[len(str(REPO)) + 1:]}:{frame.f_lineno}"
        frame = frame.f_back
    return site or "-"


class SavedTensorAccount:
    """Context manager recording every storage that autograd saves inside it (see the module docstring).

    records: one Saved per distinct storage; saves: the number of pack calls (views and repeats included).
    The saved tensors stay referenced until the account is dropped, so no storage is freed and its address
    reused while counting.
    """

    def __init__(self, model):
        self.model = model
        self.records: list[Saved] = []
        self.saves = 0
        self._seen: set[int] = set()
        self._keep: list = []
        self._stack: list[str] = []
        self._handles: list = []
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._param_shapes = {tuple(p.shape) for p in model.parameters()}

    def _push(self, name):
        def hook(module, args):
            self._stack.append(name)
        return hook

    def _pop(self, name):
        def hook(module, args, output):
            if self._stack and self._stack[-1] == name:
                self._stack.pop()
        return hook

    def _pack(self, t):
        import torch

        self.saves += 1
        if t.layout != torch.strided or t.device.type == "meta":
            return t
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._seen or storage.nbytes() == 0:
            return t
        self._seen.add(ptr)
        self._keep.append(t)
        base = t._base if t._base is not None else t
        if ptr in self._params:
            kind = "parameter"
        elif tuple(base.shape) in self._param_shapes and (
                base.grad_fn is None or "ToCopy" in type(base.grad_fn).__name__):
            kind = "weight-shaped"  # autocast's weight casts, the fused loss's LM-head gradient: per step
        else:
            kind = "activation"
        module = self._stack[-1] if self._stack else "<top>"
        self.records.append(Saved(module, _site(sys._getframe(1)), str(t.dtype).removeprefix("torch."),
                                  tuple(t.shape), storage.nbytes(), kind))
        return t

    def __enter__(self):
        import torch

        for name, module in self.model.named_modules():
            name = name or "<model>"
            self._handles.append(module.register_forward_pre_hook(self._push(name)))
            self._handles.append(module.register_forward_hook(self._pop(name), always_call=True))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return False


def per_token_shape(shape: tuple[int, ...], tokens: int) -> str:
    """The shape with its token dimension dropped (leading batch 1s too); "T" marks tokens split over adjacent
    dims (chunks x chunk size), "T+j" a token dimension padded by j <= 8 (a conv's left context); the full shape,
    marked fixed, when no dimension counts tokens."""
    dims = list(shape)
    while len(dims) > 1 and dims[0] == 1:
        dims.pop(0)
    if tokens in dims:
        dims.remove(tokens)
        return "[" + ", ".join(map(str, dims)) + "]"
    for i in range(len(dims) - 1):
        if dims[i] * dims[i + 1] == tokens:
            return "[" + ", ".join(["T", *map(str, dims[:i] + dims[i + 2:])]) + "]"
    for i, d in enumerate(dims):
        if tokens < d <= tokens + 8:
            return "[" + ", ".join([*map(str, dims[:i]), f"T+{d - tokens}", *map(str, dims[i + 1:])]) + "]"
    return "fixed [" + ", ".join(map(str, shape)) + "]"


def measure(model, input_ids, dtype: str = "autocast-bf16") -> dict:
    """The saved-tensor account of one training forward of model (HiloForCausalLM, in train mode) on
    input_ids [B, T] (labels = input_ids). dtype "autocast-bf16" runs under torch.autocast(bfloat16) on the
    inputs' device; other dtypes run as the weights are. Returns a dict: loss, tokens, num_layers, params,
    saves (pack calls), records (list[Saved])."""
    import contextlib

    import torch

    model.train()
    device = input_ids.device.type
    ctx = torch.autocast(device, dtype=torch.bfloat16) if dtype == "autocast-bf16" else contextlib.nullcontext()
    with ctx, SavedTensorAccount(model) as account:
        loss = model(input_ids=input_ids, labels=input_ids, use_cache=False, return_logits=False).loss
    result = {"loss": float(loss.detach()), "tokens": input_ids.numel(), "num_layers": model.config.num_layers,
              "params": sum(p.numel() for p in model.parameters()), "saves": account.saves,
              "records": account.records}
    del loss, account
    return result


def summarize(result: dict, top: int = 15, kernel_detail: bool = False) -> dict:
    """Bytes per token: all activations, per layer (shell and kernel op), outside the layers; weight-shaped bytes;
    and the top entries per layer grouped by (module pattern, site, dtype, shape per token), the kernel op's saves
    as one entry per module unless kernel_detail (they are the CPU backends': see the module docstring)."""
    tokens, layers = result["tokens"], result["num_layers"]
    acts = [r for r in result["records"] if r.kind == "activation"]
    layer = [r for r in acts if r.in_layer]
    per_layer = sum(r.nbytes for r in layer) / tokens / layers
    kernel = sum(r.nbytes for r in layer if r.site == KERNEL_OP) / tokens / layers
    groups: dict[tuple, float] = defaultdict(float)
    for r in layer:
        if r.site == KERNEL_OP and not kernel_detail:
            key = (r.pattern, r.site, "-", "(all)")
        else:
            key = (r.pattern, r.site, r.dtype, per_token_shape(r.shape, tokens))
        groups[key] += r.nbytes / tokens / layers
    entries = sorted(groups.items(), key=lambda kv: -kv[1])[:top]
    return {
        "params": result["params"],
        "all": sum(r.nbytes for r in acts) / tokens,
        "per_layer": per_layer,
        "shell": per_layer - kernel,
        "kernel": kernel,
        "outside": sum(r.nbytes for r in acts if not r.in_layer) / tokens,
        "weight_shaped": sum(r.nbytes for r in result["records"] if r.kind == "weight-shaped"),
        "top": [{"module": k[0], "site": k[1], "dtype": k[2], "shape": k[3], "bytes": v} for k, v in entries],
    }


def _kib(x: float) -> str:
    return f"{x / 1024:.2f}"


def table(rows: list[dict], seq_len: int, dtype: str, top: int) -> str:
    lines = [
        (f"Saved-for-backward bytes per token (KiB) of one training forward, batch 1, T = {seq_len}, {dtype}, CPU; "
         "per layer = the layers' total / num_layers. kernel op = the operators' torch backends (the CPU path): the "
         "Triton backends on CUDA save different tensors, so only the shell column carries over to the GPU."),
        "",
        ("| family | size | params (M) | all | per layer | shell / layer | kernel op / layer | outside layers | "
         "weight-shaped (MiB) |"),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        s = r["summary"]
        lines.append(f"| {r['family']} | {r['size']} | {s['params'] / 1e6:.1f} | {_kib(s['all'])} | "
                     f"{_kib(s['per_layer'])} | {_kib(s['shell'])} | {_kib(s['kernel'])} | {_kib(s['outside'])} | "
                     f"{s['weight_shaped'] / 2**20:.1f} |")
    for r in rows:
        s = r["summary"]
        lines += ["", f"{r['family']}: top {top} per layer (KiB per token per layer, share of the layer's)", "",
                  "| module | saved at | dtype | shape / token | KiB | share |", "|---|---|---|---|---:|---:|"]
        for e in s["top"]:
            lines.append(f"| {e['module']} | {e['site']} | {e['dtype']} | {e['shape']} | {_kib(e['bytes'])} | "
                         f"{100 * e['bytes'] / s['per_layer']:.1f}% |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--size", default="340m", help="model/size preset (default 340m)")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens of the one row (default 512)")
    ap.add_argument("--dtype", default="autocast-bf16", choices=DTYPES,
                    help="autocast-bf16: fp32 weights under bf16 autocast (training); float32 / bfloat16: weights "
                         "in that dtype, no autocast")
    ap.add_argument("--top", type=int, default=15, help="entries listed per family")
    ap.add_argument("--kernel-detail", action="store_true",
                    help="list the kernel op's saved tensors one by one (default: one entry per module)")
    ap.add_argument("--vocab-size", type=int, default=None, help="default: the tokenizer config's (8192)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every model (model.key=value)")
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    args = ap.parse_args([a for a in argv if a not in overrides])
    args.overrides = [*args.overrides, *overrides]
    if args.seq_len < 1:
        ap.error("--seq-len must be >= 1")

    import torch

    device = torch.device("cpu")
    weights = torch.float32 if args.dtype == "autocast-bf16" else getattr(torch, args.dtype)
    rows = []
    for family in args.families:
        model, config = build(family, args.size, max(args.seq_len, 2), args.overrides, args.vocab_size, device,
                              weights)
        ids = torch.randint(0, config.vocab_size, (1, args.seq_len), generator=torch.Generator().manual_seed(0))
        result = measure(model, ids, args.dtype)
        rows.append({"family": family, "size": args.size, "loss": result["loss"],
                     "summary": summarize(result, args.top, args.kernel_detail)})
        del model, result
        print(f"{family}: done", file=sys.stderr, flush=True)
    text = table(rows, args.seq_len, args.dtype, args.top)
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
