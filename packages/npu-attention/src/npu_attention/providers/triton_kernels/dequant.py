"""8-bit KV codes (int8, float8_e4m3fn) to 16-bit floats in registers, exactly.

A conversion instruction (``I2F``, ``F2F``) runs at a quarter of the rate of plain
integer and float arithmetic on Hopper, and a decode over 8-bit pages converts every
key and value it reads: at the bandwidth of an H100 that is most of what the
conversion units can do. These conversions use integer and float arithmetic only,
four codes (one 32-bit register) at a time:

* int8 to bfloat16: each byte, offset by 128, becomes the low byte of the float32
  ``2**23 + u``; subtracting ``2**23 + 128`` leaves the code, whose top 16 bits are
  its bfloat16 (integers up to 128 in magnitude are exact there).
* int8 to float16: the same with the float16 ``1024 + u`` of two codes at once.
* e4m3 to bfloat16: sign, exponent and mantissa are moved into bfloat16's fields
  (bias 127 in place of 7), then multiplied by ``2**120``, which also gives e4m3's
  subnormals their values. NaN codes (never written: the write saturates, but
  memory past a request's keys may hold anything) read as +-480, so that a key past
  the end meets a probability of 0 rather than 0 * NaN.
* e4m3 to float16: the same into float16's fields (bias 15), times ``2**8``.

``dequant_tl`` (Triton) and ``dequant_gl`` (Gluon) take a tensor of codes and the
target dtype; CUDA only (the interpreter keeps ``tensor.to``).
"""

import triton
import triton.language as tl

_INT8_TO_BF16 = """{
.reg .b32 u, f0, f1, f2, f3;
xor.b32 u, $2, 0x80808080;
prmt.b32 f0, u, 0x4B000000, 0x7650;
prmt.b32 f1, u, 0x4B000000, 0x7651;
prmt.b32 f2, u, 0x4B000000, 0x7652;
prmt.b32 f3, u, 0x4B000000, 0x7653;
sub.f32 f0, f0, 0f4B000080;
sub.f32 f1, f1, 0f4B000080;
sub.f32 f2, f2, 0f4B000080;
sub.f32 f3, f3, 0f4B000080;
prmt.b32 $0, f0, f1, 0x7632;
prmt.b32 $1, f2, f3, 0x7632;
}"""

_INT8_TO_F16 = """{
.reg .b32 u, h0, h1, m;
xor.b32 u, $2, 0x80808080;
prmt.b32 h0, u, 0x64646464, 0x4140;
prmt.b32 h1, u, 0x64646464, 0x4342;
mov.b32 m, 0x64806480;
sub.f16x2 $0, h0, m;
sub.f16x2 $1, h1, m;
}"""

_E4M3_TO_BF16 = """{
.reg .b32 a, b, t, s, c, z;
prmt.b32 a, $2, 0, 0x1404;
prmt.b32 b, $2, 0, 0x3424;
mov.b32 c, 0x7B807B80;
mov.b32 z, 0x80008000;
shr.b32 t, a, 4;
and.b32 t, t, 0x07F007F0;
and.b32 s, a, 0x80008000;
or.b32 a, s, t;
shr.b32 t, b, 4;
and.b32 t, t, 0x07F007F0;
and.b32 s, b, 0x80008000;
or.b32 b, s, t;
fma.rn.bf16x2 $0, a, c, z;
fma.rn.bf16x2 $1, b, c, z;
}"""

_E4M3_TO_F16 = """{
.reg .b32 a, b, t, s, c, z;
prmt.b32 a, $2, 0, 0x1404;
prmt.b32 b, $2, 0, 0x3424;
mov.b32 c, 0x5C005C00;
mov.b32 z, 0x80008000;
shr.b32 t, a, 1;
and.b32 t, t, 0x3F803F80;
and.b32 s, a, 0x80008000;
or.b32 a, s, t;
shr.b32 t, b, 1;
and.b32 t, t, 0x3F803F80;
and.b32 s, b, 0x80008000;
or.b32 b, s, t;
fma.rn.f16x2 $0, a, c, z;
fma.rn.f16x2 $1, b, c, z;
}"""

# Hopper's paired conversion (a quarter-rate instruction, two codes each); NaN codes
# stay NaN, so a caller masks codes past its keys itself.
_E4M3_TO_F16_CVT = tl.constexpr("""{
.reg .b16 lo, hi;
mov.b32 {lo, hi}, $2;
cvt.rn.f16x2.e4m3x2 $0, lo;
cvt.rn.f16x2.e4m3x2 $1, hi;
}""")


@triton.constexpr_function
def _asm(src, dst):
    """The conversion of ``src`` codes (``int8`` / ``fp8e4nv``) to ``dst``
    (``bf16`` / ``fp16``)."""
    table = {
        ("int8", "bf16"): _INT8_TO_BF16,
        ("int8", "fp16"): _INT8_TO_F16,
        ("fp8e4nv", "bf16"): _E4M3_TO_BF16,
        ("fp8e4nv", "fp16"): _E4M3_TO_F16,
    }
    return table[(str(getattr(src, "value", src)), str(getattr(dst, "value", dst)))]


@triton.jit
def dequant_tl(codes, DST: tl.constexpr):
    """``codes`` (int8 / float8e4nv) as ``DST`` (bfloat16 / float16), same values."""
    asm: tl.constexpr = _asm(codes.dtype, DST)
    if DST == tl.bfloat16:  # noqa: SIM300 (DST is a constexpr)
        return tl.inline_asm_elementwise(asm, "=r,=r,r", [codes], tl.bfloat16, True, 4)
    else:
        return tl.inline_asm_elementwise(asm, "=r,=r,r", [codes], tl.float16, True, 4)


try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    @gluon.jit
    def dequant_gl(codes, DST: gl.constexpr):
        """``codes`` (int8 / float8e4nv) as ``DST`` (bfloat16 / float16), same values."""
        asm: gl.constexpr = _asm(codes.dtype, DST)
        if DST == gl.bfloat16:  # noqa: SIM300 (DST is a constexpr)
            return gl.inline_asm_elementwise(asm, "=r,=r,r", [codes], gl.bfloat16, True, 4)
        else:
            return gl.inline_asm_elementwise(asm, "=r,=r,r", [codes], gl.float16, True, 4)

    @gluon.jit
    def e4m3_to_f16_cvt_gl(codes):
        """float8e4nv ``codes`` as float16 by ``cvt.rn.f16x2.e4m3x2``; NaN stays NaN."""
        return gl.inline_asm_elementwise(_E4M3_TO_F16_CVT, "=r,=r,r", [codes], gl.float16, True, 4)

except ImportError:  # older Triton, triton-ascend
    pass
