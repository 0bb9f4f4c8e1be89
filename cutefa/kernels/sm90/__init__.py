"""Building blocks of the sm90-family (FlashAttention-3 design) kernels: TMA, WGMMA, warp roles."""
