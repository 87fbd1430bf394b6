# Type stub of the optional C extension built from featbake/kernels.c (see featbake/native.py).

def dequant(
    src: int, row_stride: int, rows: int, d: int, dst: int, scheme: int, out: int
) -> tuple[float, float, int]: ...
def read_rows(
    spans: list[tuple[int, int, int, int, int, int, int, int]],
    crc_fn: int,
    scheme: int,
    out: int,
    d: int,
    threads: int = 1,
) -> tuple[tuple[int, int, int] | None, float, float]: ...
def crc32c(crc: int, address: int, nbytes: int, crc_fn: int) -> int: ...
def set_width(width: int) -> int: ...
