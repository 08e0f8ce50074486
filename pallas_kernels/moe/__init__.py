"""Mixture-of-experts kernels: the dispatch door (`routed_experts`), the grouped SwiGLU
over expert-sorted rows (`grouped_ffn`) and their pure-jnp references."""

from jaxpar.pallas_kernels.moe.dispatch import routed_experts
from jaxpar.pallas_kernels.moe.grouped import IMPLEMENTATIONS, grouped_ffn
from jaxpar.pallas_kernels.moe.reference import grouped_ffn_reference, routed_experts_reference, silu_glu
from jaxpar.pallas_kernels.moe.rows import rank_within, take_rows

__all__ = ["IMPLEMENTATIONS", "grouped_ffn", "grouped_ffn_reference", "rank_within",
           "routed_experts", "routed_experts_reference", "silu_glu", "take_rows"]
