"""cutefa inside the stacks people already use.

- :mod:`cutefa.integrations.transformers`: ``attn_implementation="cutefa"`` for Hugging Face
  transformers models (``register()`` adds it).

PyTorch's own SDPA provider registry is served by :mod:`cutefa.torch_sdpa`. Nothing here is
imported by ``import cutefa``: each integration imports its library only when registered.
"""
