"""ParoShardedModule (PaRO-DP) on the paths real training takes, multi-process on CPU: 4 ranks as 2 groups of 2.

Each case trains NNN, NNG, NGG, IIG and GGG and compares every parameter (and buffer) with one process within 1e-5.
"""

import pytest
from launch import assert_ok, launch

pytestmark = pytest.mark.multiproc

# Cases by what they vary, one launch per line (start-up dominates on 2 cores); each case runs in the same process
# after the one before it, with the engine's shared communicators (see [Note: shared lanes] in paro_torch/_comms.py).
CASES = {
    "optimizers": [
        "fused",  # AdamW(fused=True)
        "foreach",  # AdamW(foreach=True)
        "sgd",  # SGD with momentum
        "adam_l2",  # Adam with (L2) weight_decay
        "param_groups",  # optimizer groups by ParoShardedModule.named_parameters() names
        "skipped_step",  # every rank skips optimizer.step() once, as a GradScaler that found inf
    ],
    "graphs": [
        "dropped_equal",  # a block unused on one rank for one step; blocks of equal size
        "dropped_unequal",  # ditto, the unused block larger than the other
        "retain_graph",  # the first micro-step's backward with retain_graph=True
        "direct_call",  # the inner model called past the wrapper between steps (Hugging Face's and PEFT's generate)
        "nested",  # Lightning's redirection: training_step inside the wrapper's forward calls the model again
        "user_collectives",  # the user's all-reduces on their own groups in forward and backward hooks
        "reversed",  # blocks run last to first, not in registration order (gathers and reductions in run order)
        "two_forwards",  # two forwards, one backward (chosen and rejected, as reward models train)
        "dormant",  # a block unused on every rank for two steps, then used on one rank only, then on all
    ],
    "checkpointing": [
        "ckpt_nonreentrant_early",  # torch.utils.checkpoint(use_reentrant=False) around each block
        "ckpt_nonreentrant_late",  # ditto under set_checkpoint_early_stop(False)
        "ckpt_reentrant",  # torch.utils.checkpoint(use_reentrant=True) around each block
    ],
    "states": [
        "batchnorm",  # BatchNorm1d in a block and at the root: parameters and running stats (rank 0's)
        "seeds",  # each rank builds the model with its own seed: rank 0's parameters and buffers win
        "buffer_changes",  # a constant buffer, doubled after step 1: broadcast in the first step and after changes
        "meta",  # built on the meta device, initialised unit by unit by param_init_fn
    ],
    "contract": [
        "edit_after_eval",  # after step 1: an evaluation forward, then the parameters halved in place
        "moved",  # .to("cpu"), .cpu(), .float(), .double().float() between steps; .to("meta") refused
        "abandoned_window",  # a window dropped after one micro-step (zero_grad(), no step): not carried over
        "abandoned_window_inplace",  # ditto with zero_grad(set_to_none=False)
        "zero_grad_inplace",  # every zero_grad(set_to_none=False)
        "input_grad",  # an adversarial step: autograd.grad of the loss to the inputs, then the perturbed loss
        "grad_penalty",  # a penalty on the gradient to the inputs, taken with create_graph=True
    ],
    "errors": [
        "backward_error",  # a backward raises midway on every rank; the step is skipped and training goes on
        "forward_error",  # a forward raises inside a block on every rank; that micro-step is left out
        "inference_first",  # the first forward under inference_mode, communication on the calling thread (as CUDA)
    ],
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", CASES)
def test_training_paths_match_one_process(kind: str) -> None:
    # bounded: an engine whose ranks disagree on collectives hangs (the worker dumps its stacks after 150 s of a case)
    cases = CASES[kind]
    assert_ok(
        launch("engine_paths.py", 4, env={"PARO_GROUP_SIZE": "2"}, args=(",".join(cases),), timeout=90 * len(cases))
    )


def test_meta_device_model_wraps_within_shards_plus_a_unit() -> None:
    """Peak memory while wrapping a model built on the meta device in GGG, IIG and NNG: the shards plus about two
    units, not the model."""
    env = {"PARO_GROUP_SIZE": "2", "MALLOC_MMAP_THRESHOLD_": "131072"}  # freed buffers leave the resident set
    out = assert_ok(launch("engine_meta_memory.py", 4, env=env, args=("GGG,IIG,NNG",), timeout=300))
    print(out)


def test_memory_follows_the_run_on_common_shapes() -> None:
    """Measured peak memory (resident set) of a UNet run out of registration order, a vision tower no rank runs, a
    block one rank skips and two forwards before one backward, against a chain of as many blocks, in GGG and IIG;
    and the memory gradients take beyond the accumulator (see tests/workers/engine_memory.py)."""
    env = {"PARO_GROUP_SIZE": "2", "MALLOC_MMAP_THRESHOLD_": "131072"}  # freed buffers leave the resident set
    print(assert_ok(launch("engine_memory.py", 4, env=env, args=("GGG,IIG",), timeout=400)))
