"""Child process of test_checkpoint: saves step 1, then is killed while saving step 2.

Usage: python save_and_hang.py DIRECTORY. Prints "saving" once step 2's arrays are being written;
the commit (the rename of the temporary folder) of step 2 is held back so the parent's SIGKILL
lands mid-save every time rather than by luck of timing.
"""

import asyncio
import sys

import jax
import optax
from orbax.checkpoint._src.path import atomicity

from mtjax.train.checkpoint import Checkpointer
from mtjax.train.state import init_train_state
from tests.train.tiny_lm import TinyLM


async def _never_commit(self, *args, **kwargs):
    await asyncio.sleep(3600)


state = init_train_state(TinyLM(), optax.adam(1e-3), jax.random.PRNGKey(0), (2, 8))
checkpointer = Checkpointer(sys.argv[1], save_every=1)
checkpointer.save(1, state, {"data": {"position": 1}})
checkpointer.wait()
atomicity.AtomicRenameTemporaryPath.finalize = _never_commit
checkpointer.save(2, state.replace(step=state.step + 1), {"data": {"position": 2}})
print("saving", flush=True)
asyncio.run(asyncio.sleep(3600))
