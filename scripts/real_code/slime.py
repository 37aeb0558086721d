"""slime's REAL calculate_log_probs_and_entropy (slime/utils/ppo_utils.py of a checkout; checked
at THUDM/slime 624b824) against the integration's replacement and the test stand-in, each
against float64. Not run by CI (slime ships no package); docs/integrations.md:

    SLIME_CHECKOUT=/path/to/slime python scripts/real_code/slime.py               # tp 1
    SLIME_CHECKOUT=/path/to/slime torchrun --standalone --nproc-per-node 2 scripts/real_code/slime.py
"""
import importlib.util
import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "unit"))
spec = importlib.util.spec_from_file_location(
    "real_ppo", os.path.join(os.environ["SLIME_CHECKOUT"], "slime", "utils", "ppo_utils.py"))
real = importlib.util.module_from_spec(spec); spec.loader.exec_module(real)
import _slime_standin as standin
from megatron_vocabstats.integrations import slime_ops

if "RANK" in os.environ:
    dist.init_process_group("gloo")
group = dist.group.WORLD if dist.is_initialized() else None
rank, tp = (dist.get_rank(), dist.get_world_size()) if group else (0, 1)
torch.manual_seed(0)
T, V = 64, 1000
W = V // tp
full = torch.randn(T, V, dtype=torch.float64) * 4
tokens = torch.randint(0, V, (T,))
tokens_oov = tokens.clone(); tokens_oov[::7] = -100; tokens_oov[3] = V + 5
keep_full = torch.rand(T, V) < 0.3
wl = torch.rand(T, dtype=torch.float64) + 0.5
wh = torch.rand(T, dtype=torch.float64) - 0.5

def ref(tok, keep=None):
    z = full.clone().requires_grad_()
    m = z.detach().amax(-1, keepdim=True)
    ent = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)
    zz = z
    if keep is not None:
        k = keep.clone(); inside = (tok >= 0) & (tok < V)
        k[inside.nonzero().squeeze(-1), tok[inside]] = True
        zz = z.masked_fill(~k, float("-inf"))
        m = zz.detach().amax(-1, keepdim=True)
    inside = (tok >= 0) & (tok < V)
    pick = torch.where(inside, zz.gather(1, torch.where(inside, tok, 0)[:, None])[:, 0], m[:, 0])
    lp = pick - m[:, 0] - torch.logsumexp(zz - m, -1)  # m detached: slime's -p gradient for ids outside
    ((lp * wl).sum() + (ent * wh).sum()).backward()
    return lp.detach(), ent.detach(), z.grad[:, rank * W:(rank + 1) * W]

def run(fn, tok, keep=None, dtype=torch.float32):
    x = full[:, rank * W:(rank + 1) * W].to(dtype).clone().requires_grad_()
    k = None if keep is None else keep[:, rank * W:(rank + 1) * W].contiguous()
    lp, ent = fn(x, tok, group, with_entropy=True, log_prob_keep_mask=k, with_entropy_grad=True)
    assert lp.shape == (T, 1) and lp.dtype == torch.float32 and ent.shape == (T,), (lp.shape, lp.dtype)
    ((lp[:, 0].double() * wl).sum() + (ent.double() * wh).sum()).backward()
    return lp[:, 0].detach().double(), ent.detach().double(), x.grad.double()

for name, tok, keep in (("plain", tokens, None), ("outside ids", tokens_oov, None),
                        ("keep mask", tokens, keep_full), ("keep mask + outside", tokens_oov, keep_full)):
    r = ref(tok, keep)
    out = {n: run(f, tok, keep) for n, f in (("slime", real.calculate_log_probs_and_entropy),
                                             ("ours", slime_ops.calculate_log_probs_and_entropy),
                                             ("standin", standin.calculate_log_probs_and_entropy))}
    if rank == 0:
        for n, (lp, ent, g) in out.items():
            print(f"tp{tp} {name:20s} {n:8s} |lp-f64| {(lp - r[0]).abs().max():.2e}  |H-f64| "
                  f"{(ent - r[1]).abs().max():.2e}  |grad-f64| {(g - r[2]).abs().max():.2e}")
        print(f"tp{tp} {name:20s} ours-slime: lp {(out['ours'][0]-out['slime'][0]).abs().max():.2e} "
              f"H {(out['ours'][1]-out['slime'][1]).abs().max():.2e} grad {(out['ours'][2]-out['slime'][2]).abs().max():.2e}")
if dist.is_initialized():
    dist.destroy_process_group()
