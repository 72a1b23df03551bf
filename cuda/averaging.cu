// wagma fused elementwise kernels on flat contiguous buffers.
//
// Each kernel makes one pass over memory with a grid-stride loop. Arithmetic is done in fp32 and
// rounded once to the storage type. The file includes no headers on purpose: NVRTC (which CuPy uses
// at run time) does not reliably find cuda_fp16.h / cuda_bf16.h, so 16-bit values are stored as raw
// `unsigned short` and converted with bit arithmetic (bf16) or a PTX cvt instruction (fp16).
//
// fp32 arithmetic goes through add_rn / sub_rn / mul_rn, one PTX instruction each with an explicit
// rounding mode and no .ftz:
// - an explicit rounding mode keeps ptxas from contracting a*b+c into an FMA (the kernels are
//   memory-bound, so FMA would buy nothing);
// - no .ftz keeps subnormals: CuPy compiles every RawModule with -ftz=true, which turns the
//   add_rn-style intrinsics into add.rn.ftz.f32 and flushes subnormal inputs and results to zero.
// So every result is bit-identical to the torch reference implementation in wagma/kernels.py (the
// test oracle), whatever flags compile this file.
//
// Host emulation: tests/test_kernel_emulation.py compiles this file with g++ and runs the kernels on
// the CPU against the references. It defines WAGMA_HOST_EMULATION and supplies IEEE-equivalent host
// versions of the PTX primitives below and of the CUDA built-ins; nothing else is changed.
//
// Exported names are extern "C" (unmangled) with a dtype suffix: _f32, _f16, _bf16.

typedef unsigned short u16;

#ifndef WAGMA_HOST_EMULATION
// IEEE fp32 add / subtract / multiply, round to nearest even, subnormals kept, never fused.
__device__ __forceinline__ float add_rn(float a, float b) {
    float r;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float sub_rn(float a, float b) {
    float r;
    asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float mul_rn(float a, float b) {
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
// fp16 <-> fp32: widening is exact; narrowing rounds to nearest even (no .ftz: subnormal halves kept).
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 f32_to_f16_rn(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif

// Storage-type adapters: load() widens to fp32, store() rounds fp32 to the storage type.
struct F32 {
    typedef float T;
    static __device__ __forceinline__ float load(float x) { return x; }
    static __device__ __forceinline__ float store(float x) { return x; }
};

struct F16 {
    typedef u16 T;
    static __device__ __forceinline__ float load(u16 h) { return f16_to_f32(h); }
    static __device__ __forceinline__ u16 store(float f) { return f32_to_f16_rn(f); }
};

// fp32 -> bf16, round to nearest even; NaN becomes the canonical quiet NaN 0x7FC0, exactly as
// torch's CPU conversion (c10::BFloat16) does, so the kernel and the reference agree bit for bit.
__device__ __forceinline__ u16 f32_to_bf16_rne(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
        return (u16)0x7FC0u;
    }
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

__device__ __forceinline__ float bf16_to_f32(u16 b) {
    return __uint_as_float(((unsigned int)b) << 16);  // exact: bf16 is the top half of an fp32
}

struct BF16 {
    typedef u16 T;
    static __device__ __forceinline__ float load(u16 b) { return bf16_to_f32(b); }
    static __device__ __forceinline__ u16 store(float f) { return f32_to_bf16_rne(f); }
};

// Grid-stride loops with 64-bit indices (flat model buffers can exceed 2^31 elements), ILP elements
// per thread and trip, `stride` apart (so a warp's accesses stay coalesced). Each kernel loads all ILP
// elements of a trip before it stores any: independent loads in flight per thread (the kernels are
// memory-bound), with no __restrict__, so in-place calls (w == group_sum) stay exact.
// WAGMA_FOR_EACH(ILP, k, j, ...) runs its body for the trip's k-th element j, skipping j >= n.
//
// ILP per kernel: the best of 1, 2, 4, 8 at 10^8 fp32 elements on an H200 (`benchmarks/gpu.py --ilp 1,2,4,8`,
// benchmarks/results/gpu/README.md). Defining WAGMA_ILP before this file sets one value for every kernel.
#ifdef WAGMA_ILP
#define WAGMA_ILP_COMBINE WAGMA_ILP
#define WAGMA_ILP_MOMENTUM WAGMA_ILP
#define WAGMA_ILP_RESIDUAL WAGMA_ILP
#define WAGMA_ILP_PACK WAGMA_ILP
#else
#define WAGMA_ILP_COMBINE 2   // 87 % of copy at 1, 100 % at 2, 91 % at 4
#define WAGMA_ILP_MOMENTUM 1  // 95 % at 1, 92 % at 2, 85 % at 4 (three loads per element already)
#define WAGMA_ILP_RESIDUAL 2  // take 75 -> 86 %, take_add 87 -> 90 %, accumulate 87 -> 100 % (1 -> 2)
#define WAGMA_ILP_PACK 4      // 2-byte accesses: pack 68 -> 97 %, unpack 62 -> 84 % (1 -> 4)
#endif
#ifdef WAGMA_HOST_EMULATION
#define WAGMA_UNROLL
#else
#define WAGMA_UNROLL _Pragma("unroll")
#endif
#define GRID_STRIDE_TRIPS(ILP, i, stride, n)                                               \
    const long long stride = (long long)blockDim.x * gridDim.x;                            \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (ILP) * stride)
#define WAGMA_FOR_EACH(ILP, k, j, i, stride, n) \
    WAGMA_UNROLL for (int k = 0; k < (ILP); ++k) if (const long long j = (i) + k * (stride); j < (n))

// WAGMA combine: w = (w + group_sum) * inv_divisor, in place.
template <class D, int ILP>
__device__ __forceinline__ void combine(typename D::T* w, const typename D::T* sum, float inv_divisor,
                                        long long n) {
    GRID_STRIDE_TRIPS(ILP, i, stride, n) {
        float a[ILP], b[ILP];
        WAGMA_FOR_EACH(ILP, k, j, i, stride, n) { a[k] = D::load(w[j]); b[k] = D::load(sum[j]); }
        WAGMA_FOR_EACH(ILP, k, j, i, stride, n) { w[j] = D::store(mul_rn(add_rn(a[k], b[k]), inv_divisor)); }
    }
}

// Reduction momentum: d = xbar - a; v = mu*v + d; a += lr*v  (Nesterov: a += lr*(mu*v + d)).
template <class D, int ILP>
__device__ __forceinline__ void momentum(typename D::T* anchor, typename D::T* velocity,
                                         const typename D::T* average, float mu, float lr,
                                         int nesterov, long long n) {
    GRID_STRIDE_TRIPS(ILP, i, stride, n) {
        float a[ILP], x[ILP], u[ILP];
        WAGMA_FOR_EACH(ILP, k, j, i, stride, n) {
            a[k] = D::load(anchor[j]);
            x[k] = D::load(average[j]);
            u[k] = D::load(velocity[j]);
        }
        WAGMA_FOR_EACH(ILP, k, j, i, stride, n) {
            const float d = sub_rn(x[k], a[k]);
            const float v = add_rn(mul_rn(mu, u[k]), d);
            const float step = nesterov ? add_rn(mul_rn(mu, v), d) : v;
            velocity[j] = D::store(v);
            anchor[j] = D::store(add_rn(a[k], mul_rn(lr, step)));
        }
    }
}

// eager-SGD: take the pending contribution and zero it in the same pass.
template <class D, int ILP>
__device__ __forceinline__ void residual_take(typename D::T* residual, typename D::T* out,
                                              long long n) {
    GRID_STRIDE_TRIPS(ILP, i, stride, n) {
        typename D::T r[ILP];
        WAGMA_FOR_EACH(ILP, k, j, i, stride, n) { r[k] = residual[j]; }
        WAGMA_FOR_EACH(ILP, k, j, i, stride, n) {
            out[j] = r[k];     // a bit copy: no rounding
            residual[j] = 0;   // all-zero bits are +0.0 in every storage type
        }
    }
}

template <class D, int ILP>
__device__ __forceinline__ void residual_take_add(typename D::T* residual, const typename D::T* grad,
                                                  typename D::T* out, long long n) {
    GRID_STRIDE_TRIPS(ILP, i, stride, n) {
        float r[ILP], g[ILP];
        WAGMA_FOR_EACH(ILP, k, j, i, stride, n) { r[k] = D::load(residual[j]); g[k] = D::load(grad[j]); }
        WAGMA_FOR_EACH(ILP, k, j, i, stride, n) {
            out[j] = D::store(add_rn(r[k], g[k]));
            residual[j] = 0;
        }
    }
}

template <class D, int ILP>
__device__ __forceinline__ void residual_accumulate(typename D::T* residual, const typename D::T* grad,
                                                    long long n) {
    GRID_STRIDE_TRIPS(ILP, i, stride, n) {
        float r[ILP], g[ILP];
        WAGMA_FOR_EACH(ILP, k, j, i, stride, n) { r[k] = D::load(residual[j]); g[k] = D::load(grad[j]); }
        WAGMA_FOR_EACH(ILP, k, j, i, stride, n) { residual[j] = D::store(add_rn(r[k], g[k])); }
    }
}

// One extern "C" entry point per (operation, dtype), so RawModule.get_function finds plain names.
#define WAGMA_INSTANTIATE(SUFFIX, D)                                                                  \
    extern "C" __global__ void wagma_combine_##SUFFIX(D::T* w, const D::T* sum, float inv_divisor,    \
                                                      long long n) {                                  \
        combine<D, WAGMA_ILP_COMBINE>(w, sum, inv_divisor, n);                                        \
    }                                                                                                 \
    extern "C" __global__ void wagma_momentum_##SUFFIX(D::T* anchor, D::T* velocity,                  \
                                                       const D::T* average, float mu, float lr,       \
                                                       int nesterov, long long n) {                   \
        momentum<D, WAGMA_ILP_MOMENTUM>(anchor, velocity, average, mu, lr, nesterov, n);              \
    }                                                                                                 \
    extern "C" __global__ void wagma_residual_take_##SUFFIX(D::T* residual, D::T* out, long long n) { \
        residual_take<D, WAGMA_ILP_RESIDUAL>(residual, out, n);                                       \
    }                                                                                                 \
    extern "C" __global__ void wagma_residual_take_add_##SUFFIX(D::T* residual, const D::T* grad,     \
                                                                D::T* out, long long n) {             \
        residual_take_add<D, WAGMA_ILP_RESIDUAL>(residual, grad, out, n);                             \
    }                                                                                                 \
    extern "C" __global__ void wagma_residual_accumulate_##SUFFIX(D::T* residual, const D::T* grad,   \
                                                                  long long n) {                      \
        residual_accumulate<D, WAGMA_ILP_RESIDUAL>(residual, grad, n);                                \
    }

WAGMA_INSTANTIATE(f32, F32)
WAGMA_INSTANTIATE(f16, F16)
WAGMA_INSTANTIATE(bf16, BF16)

// Low-precision exchange: fp32 -> bf16 (round to nearest even) and bf16 -> fp32 times scale.
extern "C" __global__ void wagma_pack_bf16(const float* src, u16* dst, long long n) {
    const int ILP = WAGMA_ILP_PACK;
    GRID_STRIDE_TRIPS(ILP, i, stride, n) {
        float x[ILP];
        WAGMA_FOR_EACH(ILP, k, j, i, stride, n) { x[k] = src[j]; }
        WAGMA_FOR_EACH(ILP, k, j, i, stride, n) { dst[j] = f32_to_bf16_rne(x[k]); }
    }
}

extern "C" __global__ void wagma_unpack_bf16(const u16* src, float* dst, float scale, long long n) {
    const int ILP = WAGMA_ILP_PACK;
    GRID_STRIDE_TRIPS(ILP, i, stride, n) {
        u16 x[ILP];
        WAGMA_FOR_EACH(ILP, k, j, i, stride, n) { x[k] = src[j]; }
        WAGMA_FOR_EACH(ILP, k, j, i, stride, n) { dst[j] = mul_rn(bf16_to_f32(x[k]), scale); }
    }
}
