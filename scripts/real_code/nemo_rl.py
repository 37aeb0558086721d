"""The NeMo-RL integration's test cases (tests/unit/dist/nemo_rl_cases.py) on NeMo-RL's REAL
model_utils.py, logits_sampling_utils.py and loss/utils.py from a checkout (checked at
NVIDIA-NeMo/RL 7ea279a) in place of the test stand-in; prints the largest differences between
NeMo-RL's results and ours. Not run by CI (NeMo-RL ships no package); docs/integrations.md:

    NEMO_RL_CHECKOUT=/path/to/RL torchrun --standalone --nproc-per-node 2 \
        scripts/real_code/nemo_rl.py --out /tmp/nemo_rl_real
"""
import importlib.util
import os
import sys
import types

HERE = os.environ["NEMO_RL_CHECKOUT"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, f"{ROOT}/tests/unit", f"{ROOT}/tests/unit/dist"]

def stub(name, **attrs):
    m = types.ModuleType(name); m.__dict__.update(attrs); m.__path__ = []
    sys.modules[name] = m; return m

def real(name, path):
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, path))
    m = importlib.util.module_from_spec(spec); sys.modules[name] = m; spec.loader.exec_module(m)
    return m

def install():
    for n in [n for n in sys.modules if n == "nemo_rl" or n.startswith("nemo_rl.")]:
        del sys.modules[n]
    stub("nemo_rl", __version__="0.6.0"); stub("nemo_rl.distributed"); stub("nemo_rl.algorithms")
    stub("nemo_rl.algorithms.loss"); stub("nemo_rl.models"); stub("nemo_rl.models.megatron")
    real("nemo_rl.algorithms.logits_sampling_utils", "nemo_rl/algorithms/logits_sampling_utils.py")
    mu = real("nemo_rl.distributed.model_utils", "nemo_rl/distributed/model_utils.py")
    class _Any:
        def __getattr__(self, n): return n
    stub("nemo_rl.algorithms.loss.interfaces", LossFunction=object, LossInputType=_Any())
    stub("nemo_rl.algorithms.utils", mask_out_neg_inf_logprobs=None)
    stub("nemo_rl.algorithms.x_token"); stub("nemo_rl.algorithms.x_token.loss_utils",
                                             prepare_xtoken_cross_tokenizer_loss_input=None)
    stub("nemo_rl.distributed.batched_data_dict", BatchedDataDict=dict)
    loss = real("nemo_rl.algorithms.loss.utils", "nemo_rl/algorithms/loss/utils.py")
    # train.py imports Megatron's training stack; its three bindings, as its import binds them
    train = stub("nemo_rl.models.megatron.train", **{n: getattr(mu, n) for n in (
        "distributed_vocab_topk", "from_parallel_logits_to_logprobs",
        "from_parallel_logits_to_logprobs_packed_sequences")})
    return {"nemo_rl.distributed.model_utils": mu, "nemo_rl.algorithms.loss.utils": loss,
            "nemo_rl.models.megatron.train": train}

import torch  # noqa: E402

# NeMo-RL's AllGatherCPTensor.backward builds its index with pin_memory=True and .cuda(): on this
# CPU-only machine, both are made no-ops in this process (the values are unchanged).
_tensor = torch.tensor
torch.tensor = lambda *a, pin_memory=False, **k: _tensor(*a, **k)
torch.Tensor.cuda = lambda self, *a, **k: self
import _nemo_rl_standin
_nemo_rl_standin.install = install
import nemo_rl_cases
from _harness import main
import collections, torch.distributed as dist
MAX = collections.defaultdict(float)
_close = nemo_rl_cases._close
def close(a, b, tol, what):
    if "NeMo-RL" in what:
        err = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
        MAX[what] = max(MAX[what], err)
    _close(a, b, tol, what)
nemo_rl_cases._close = close
main(nemo_rl_cases.CASES, timeout_s=120.0)
if int(os.environ["RANK"]) == 0:
    for k, v in sorted(MAX.items()):
        print(f"MAXDIFF {k}: {v:.3g}")
