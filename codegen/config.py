"""The configuration of one generated kernel and its canonical key.

Every op reduces to one of three kernel families over a forward-convolution
problem ``src (N, Cin, Y...) * W -> dst (N, Cout, X...)``:

- ``bwd_data``: diff_src from diff_dst and W (ConvolutionBackpropData/BackwardData);
- ``fwd``: dst from src and W (ConvTransposeBackwardData is a forward convolution);
- ``bwd_weights``: diff_W from src and diff_dst (the weight-gradient ops; the
  ConvTranspose one swaps the roles of its two data tensors).

What is fixed here is compiled into the C as constants; batch, spatial sizes and
pads are run-time arguments, so one kernel serves every batch and image size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from functools import lru_cache

from convgrad.codegen.rules_problem import narrowed_isa

FAMILIES = ("fwd", "bwd_data", "bwd_weights")
DATA_FORMATS = ("NXC", "NCX")
# In the forward-convolution problem's terms: (O, I/g, k...), (k..., I/g, O), (O, k..., I/g)
WEIGHTS_FORMATS = ("OIX", "XIO", "OXI")
DTYPES = ("f32", "f16", "bf16")
# ISA paths: the portable C path, then x86's and aarch64's, each list by capability.
ISAS = ("portable", "avx2", "avx512", "avx512bf16", "neon", "sve256")
# ISA paths that add instructions for some dtypes only: for the other dtypes they are
# their base path, so those kernels (and their cache entries) are shared.
ISA_EXTENSIONS: dict[str, tuple[tuple[str, ...], str]] = {"avx512bf16": (("bf16",), "avx512")}


@dataclass(frozen=True)
class KernelConfig:
    """Everything that is a compile-time constant of one kernel."""

    family: str
    kernel: tuple[int, ...]  # taps per spatial axis; its length is the spatial rank
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    groups: int
    cin_per_group: int  # channels of the problem's src per group
    cout_per_group: int  # channels of the problem's dst per group
    data_format: str
    weights_format: str
    dtype: str
    isa: str = "portable"

    def __post_init__(self) -> None:
        rank = len(self.kernel)
        checks = [
            (self.family in FAMILIES, f"family {self.family!r} not in {FAMILIES}"),
            (1 <= rank <= 3, f"spatial rank {rank} not in 1..3"),
            (len(self.strides) == rank and len(self.dilations) == rank,
             "kernel, strides and dilations must have one entry per spatial axis"),
            (all(v >= 1 for v in self.kernel + self.strides + self.dilations),
             "kernel, strides and dilations must be >= 1"),
            (min(self.groups, self.cin_per_group, self.cout_per_group) >= 1,
             "groups and channels per group must be >= 1"),
            (self.data_format in DATA_FORMATS, f"data_format {self.data_format!r}"),
            (self.weights_format in WEIGHTS_FORMATS, f"weights_format {self.weights_format!r}"),
            (self.dtype in DTYPES, f"dtype {self.dtype!r} not in {DTYPES}"),
            (self.isa in ISAS, f"isa {self.isa!r} not in {ISAS}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"invalid KernelConfig: {message}")

    @property
    def rank(self) -> int:
        return len(self.kernel)

    @property
    def name(self) -> str:
        """A readable C identifier that is unique for the configuration."""
        axes = "x".join
        return (
            f"convgrad_{self.family}_{self.rank}d_k{axes(map(str, self.kernel))}"
            f"_s{axes(map(str, self.strides))}_d{axes(map(str, self.dilations))}"
            f"_g{self.groups}_i{self.cin_per_group}_o{self.cout_per_group}"
            f"_{self.data_format.lower()}_{self.weights_format.lower()}_{self.dtype}_{self.isa}"
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> KernelConfig:
        fields = dict(data)
        for key in ("kernel", "strides", "dilations"):
            fields[key] = tuple(int(v) for v in fields[key])
        return cls(**fields)

    @property
    def depthwise(self) -> bool:
        """One input and one output channel per group: tiles vectorise across groups."""
        return self.groups > 1 and self.cin_per_group == self.cout_per_group == 1

    @property
    def pointwise(self) -> bool:
        """A 1x1 kernel with stride 1: the convolution is a matrix product per pixel."""
        return all(k == 1 for k in self.kernel) and all(s == 1 for s in self.strides)

    @property
    def vector_channels(self) -> int:
        """Channels the kernel's vectors run over: every channel of a depthwise layer,
        else those of one group that are not reduced (bwd_data: src's; fwd and
        bwd_weights: dst's)."""
        if self.depthwise:
            return self.groups
        return self.cin_per_group if self.family == "bwd_data" else self.cout_per_group

    def base_isa(self, isa: str) -> str:
        """`isa`, or its base path where `isa` adds nothing for this dtype."""
        dtypes, base = ISA_EXTENSIONS.get(isa, ((self.dtype,), isa))
        return isa if self.dtype in dtypes else base

    def with_isa(self, isa: str) -> KernelConfig:
        """This configuration on ISA path `isa`, or on its base path where `isa` adds
        nothing for this dtype (base_isa), or on avx2 where avx512's vectors would be
        mostly empty (rules_problem.narrowed_isa)."""
        return _with_isa(self, isa)


@lru_cache(maxsize=4096)
def _with_isa(config: KernelConfig, isa: str) -> KernelConfig:
    """KernelConfig.with_isa, memoised (a kernel's look-up asks for several paths)."""
    narrowed = narrowed_isa(config.base_isa(isa), config.vector_channels)
    return config if narrowed == config.isa else replace(config, isa=narrowed)
