"""Per-layer hidden states of an HF transformers causal LM, the side of ``fastdeploy-ext align`` we did not write.

torch is imported inside the function: the package works without the ``align`` extra.
"""

from __future__ import annotations

import numpy as np


def hf_decoder_states(model, token_ids=None, inputs_embeds=None) -> list[np.ndarray]:
    """``[embed, layer 0 .. L-1, norm]`` of an HF causal LM, each fp32 ``[T, hidden]``, for one teacher-forced
    forward of ``token_ids`` or of ``inputs_embeds`` ``[1, T, hidden]`` (positions 0..T-1).

    Layer outputs are taken with forward hooks, not from ``output_hidden_states[i + 1]``: transformers 5 stores the
    *normed* final state as ``hidden_states[-1]``, so indexing would blame a correct last layer."""
    import torch

    captured = []

    def keep(module, inputs, output):
        # Layers return a tensor in transformers 5 and a tuple (hidden, ...) in 4.x.
        out = output[0] if isinstance(output, tuple) else output
        captured.append(out[0].float().numpy().copy())

    hooks = [layer.register_forward_hook(keep) for layer in model.model.layers]
    try:
        with torch.no_grad():
            if inputs_embeds is None:
                inputs = {"input_ids": torch.tensor([list(token_ids)])}
            else:
                inputs = {"inputs_embeds": inputs_embeds}
            length = next(iter(inputs.values())).shape[1]
            out = model(**inputs, position_ids=torch.arange(length)[None], output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    states = out.hidden_states
    return [states[0][0].float().numpy()] + captured + [states[-1][0].float().numpy()]
