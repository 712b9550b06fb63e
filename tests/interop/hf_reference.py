"""Runs Hugging Face folders with transformers (for tests/interop/test_hf.py; needs torch and transformers).

    python hf_reference.py '[{"folder": ..., "npz": ..., "out": ...}, ...]'

For each job: loads ``folder`` with ``AutoModel`` / ``AutoModelForCausalLM`` (float32, eager attention), runs it
on the ``input_ids`` (and ``token_type_ids``) of ``npz`` and saves the logits (the last hidden state of a
BERT model) to ``out`` (.npy).
"""

import json
import sys

import numpy as np
import torch
import transformers


def main() -> None:
    for job in json.loads(sys.argv[1]):
        config = transformers.AutoConfig.from_pretrained(job["folder"])
        auto = transformers.AutoModel if config.model_type == "bert" else transformers.AutoModelForCausalLM
        extra = {"add_pooling_layer": False} if config.model_type == "bert" else {}
        model = auto.from_pretrained(job["folder"], dtype=torch.float32, attn_implementation="eager", **extra).eval()
        with np.load(job["npz"]) as arrays:
            inputs = {k: torch.from_numpy(arrays[k]) for k in ("input_ids", "token_type_ids") if k in arrays}
        with torch.no_grad():
            out = model(**inputs)
        output = out.last_hidden_state if config.model_type == "bert" else out.logits
        np.save(job["out"], output.numpy().astype(np.float32))


if __name__ == "__main__":
    main()
