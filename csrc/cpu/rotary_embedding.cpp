// CPU kernels of torchops.rotary_embedding, its backward and the in-place
// rotary_embedding_.
//
// Parallel over (b, s) rows.  Each row's cos and sin are converted once to
// the compute type and reused for every head of q and k, in the form
//
//   out[j] = x[j] c[j] + x[p(j)] ss[j]
//
// with p the pairing (halves: j <-> j + rotary_dim / 2; interleaved:
// 2i <-> 2i + 1) and ss = -sin on an "a" entry, +sin on a "b" entry.  The
// backward is the same loop on the output gradient with ss[p(j)] for ss (p
// is its own inverse), so one vectorised loop serves both.  The gradients of
// cos and sin are summed per (cos row) in a fixed order (batch, then q's
// heads, then k's): deterministic for any thread count.
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common/rotary_embedding_steps.h"
#include "cpu/common/parallel.h"

namespace torchops::cpu {
namespace {

// Rows of about this many elements (heads x head size) per parallel task.
constexpr int64_t kRotaryGrain = 16384;

// out[j] = x[j] c[j] + x[p(j)] ss[j] for j < rd (rd = 2 h).
template <typename acc_t>
inline __attribute__((always_inline)) void rotate_impl(
    const acc_t* __restrict__ x, const acc_t* __restrict__ c,
    const acc_t* __restrict__ ss, acc_t* __restrict__ o, int64_t h,
    bool interleaved) {
  if (interleaved) {
    for (int64_t i = 0; i < h; ++i) {
      o[2 * i] = x[2 * i] * c[2 * i] + x[2 * i + 1] * ss[2 * i];
      o[2 * i + 1] = x[2 * i + 1] * c[2 * i + 1] + x[2 * i] * ss[2 * i + 1];
    }
  } else {
    for (int64_t j = 0; j < h; ++j) {
      o[j] = x[j] * c[j] + x[j + h] * ss[j];
    }
    for (int64_t j = 0; j < h; ++j) {
      o[j + h] = x[j + h] * c[j + h] + x[j] * ss[j + h];
    }
  }
}

// acc_c[j] += dy[j] x[j], acc_s[j] += dy[j] x[p(j)].
template <typename acc_t>
inline __attribute__((always_inline)) void accumulate_impl(
    const acc_t* __restrict__ dy, const acc_t* __restrict__ x,
    acc_t* __restrict__ acc_c, acc_t* __restrict__ acc_s, int64_t h,
    bool interleaved) {
  for (int64_t j = 0; j < 2 * h; ++j) {
    acc_c[j] += dy[j] * x[j];
  }
  if (interleaved) {
    for (int64_t i = 0; i < h; ++i) {
      acc_s[2 * i] += dy[2 * i] * x[2 * i + 1];
      acc_s[2 * i + 1] += dy[2 * i + 1] * x[2 * i];
    }
  } else {
    for (int64_t j = 0; j < h; ++j) {
      acc_s[j] += dy[j] * x[j + h];
      acc_s[j + h] += dy[j + h] * x[j];
    }
  }
}

TORCHOPS_CPU_MULTIVERSION void rotate(const float* x, const float* c,
                                      const float* ss, float* o, int64_t h,
                                      bool interleaved) {
  rotate_impl(x, c, ss, o, h, interleaved);
}

TORCHOPS_CPU_MULTIVERSION void accumulate(const float* dy, const float* x,
                                          float* acc_c, float* acc_s, int64_t h,
                                          bool interleaved) {
  accumulate_impl(dy, x, acc_c, acc_s, h, interleaved);
}

void rotate(const double* x, const double* c, const double* ss, double* o,
            int64_t h, bool interleaved) {
  rotate_impl(x, c, ss, o, h, interleaved);
}

void accumulate(const double* dy, const double* x, double* acc_c,
                double* acc_s, int64_t h, bool interleaved) {
  accumulate_impl(dy, x, acc_c, acc_s, h, interleaved);
}

// bfloat16 <-> float with integer operations only, so the loops vectorise
// (c10's conversion branches on NaN).  Rounding: to nearest even, NaN kept.
TORCHOPS_CPU_MULTIVERSION void bf16_to_float(const uint16_t* __restrict__ src,
                                             float* __restrict__ dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &bits, sizeof bits);
  }
}

TORCHOPS_CPU_MULTIVERSION void float_to_bf16(const float* __restrict__ src,
                                             uint16_t* __restrict__ dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, src + i, sizeof u);
    const uint32_t rounded = (u + ((u >> 16) & 1u) + 0x7FFFu) >> 16;
    const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
    dst[i] = static_cast<uint16_t>(nan ? 0x7FC0u : rounded);
  }
}

template <typename scalar_t, typename acc_t>
void load(const scalar_t* p, int64_t stride, int64_t n, acc_t* dst) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (stride == 1) {
      bf16_to_float(reinterpret_cast<const uint16_t*>(p), dst, n);
      return;
    }
  }
  if (stride == 1) {
    for (int64_t i = 0; i < n; ++i) {
      dst[i] = static_cast<acc_t>(p[i]);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      dst[i] = static_cast<acc_t>(p[i * stride]);
    }
  }
}

template <typename scalar_t, typename acc_t>
void store(const acc_t* src, int64_t n, scalar_t* p, int64_t stride) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (stride == 1) {
      float_to_bf16(src, reinterpret_cast<uint16_t*>(p), n);
      return;
    }
  }
  if (stride == 1) {
    for (int64_t i = 0; i < n; ++i) {
      p[i] = static_cast<scalar_t>(src[i]);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      p[i * stride] = static_cast<scalar_t>(src[i]);
    }
  }
}

// Whether entry j of a rotary dim of 2 h is the "a" of its pair (its sin
// term is subtracted).
inline bool is_a(int64_t j, int64_t h, bool interleaved) {
  return interleaved ? j % 2 == 0 : j < h;
}

// ss from the sin values v of a row (v[j] for entry j of the rotary dim):
// ss[j] = -v[j] on an "a" entry, +v[j] on a "b" entry; `transpose` gives
// the backward's ss[p(j)] instead.  Straight loops, so they vectorise.
template <typename acc_t>
void signed_sin(const acc_t* __restrict__ v, int64_t h, bool interleaved,
                bool transpose, acc_t* __restrict__ ss) {
  if (interleaved) {
    for (int64_t i = 0; i < h; ++i) {
      ss[2 * i] = transpose ? v[2 * i + 1] : -v[2 * i];
      ss[2 * i + 1] = transpose ? -v[2 * i] : v[2 * i + 1];
    }
  } else if (transpose) {
    for (int64_t j = 0; j < h; ++j) {
      ss[j] = v[j + h];
      ss[j + h] = -v[j];
    }
  } else {
    for (int64_t j = 0; j < h; ++j) {
      ss[j] = -v[j];
      ss[j + h] = v[j + h];
    }
  }
}

// The coefficients c, ss of row (b, s) of a functional call; `transpose`
// gives the backward's ss[p(j)].  tmp: rd scratch values.
template <typename scalar_t, typename acc_t>
void hf_coefficients(const RotaryArgs<scalar_t>& a, int64_t b, int64_t s,
                     bool transpose, acc_t* c, acc_t* ss, acc_t* tmp) {
  const int64_t rd = a.g.rd, h = rd / 2;
  const int64_t bc = a.g.Bc == 1 ? 0 : b;
  const scalar_t* cr = a.cos + bc * a.cv.sb + s * a.cv.ss;
  const scalar_t* sr = a.sin + bc * a.sv.sb + s * a.sv.ss;
  load(cr, a.cv.sd, rd, c);
  load(sr, a.sv.sd, rd, tmp);
  signed_sin(tmp, h, a.interleaved, transpose, ss);
}

// The coefficients of a cache row (the in-place op): cos_a = cos_b = cos[i].
template <typename scalar_t, typename acc_t>
void cache_coefficients(const RotaryArgs<scalar_t>& a, int64_t pos, acc_t* c,
                        acc_t* ss, acc_t* tmp) {
  const int64_t rd = a.g.rd, h = rd / 2;
  const scalar_t* cr = a.cos + pos * a.cv.ss;
  const scalar_t* sr = a.sin + pos * a.cv.ss;
  // The cache holds h values of each; spread them over the rd entries.
  load(cr, a.cv.sd, h, tmp);
  load(sr, a.cv.sd, h, tmp + h);
  if (a.interleaved) {
    for (int64_t i = 0; i < h; ++i) {
      c[2 * i] = tmp[i];
      c[2 * i + 1] = tmp[i];
      ss[2 * i] = -tmp[h + i];
      ss[2 * i + 1] = tmp[h + i];
    }
  } else {
    for (int64_t i = 0; i < h; ++i) {
      c[i] = tmp[i];
      c[i + h] = tmp[i];
      ss[i] = -tmp[h + i];
      ss[i + h] = tmp[h + i];
    }
  }
}

// Rotates every head of q and k in row (b, s): out = rot(in) on the first
// rd entries, the rest copied (unless in place).
template <typename scalar_t, typename acc_t>
void rotate_row(const RotaryArgs<scalar_t>& a, const scalar_t* const* in,
                const RotaryView* iv, int64_t b, int64_t s, const acc_t* c,
                const acc_t* ss, acc_t* xbuf, acc_t* obuf) {
  const RotaryGeometry& g = a.g;
  const int64_t rd = g.rd;
  for (int t = 0; t < 2; ++t) {
    const scalar_t* xrow = in[t] + b * iv[t].sb + s * iv[t].ss;
    scalar_t* orow = a.out[t] + b * a.ov[t].sb + s * a.ov[t].ss;
    const bool in_place = static_cast<const void*>(xrow) == orow &&
                          iv[t].sh == a.ov[t].sh && iv[t].sd == a.ov[t].sd;
    for (int64_t hd = 0; hd < g.H[t]; ++hd) {
      const scalar_t* x = xrow + hd * iv[t].sh;
      scalar_t* o = orow + hd * a.ov[t].sh;
      if (std::is_same_v<scalar_t, acc_t> && !in_place && iv[t].sd == 1 &&
          a.ov[t].sd == 1) {
        // float and double: straight from the input to the output.
        rotate(reinterpret_cast<const acc_t*>(x), c, ss,
               reinterpret_cast<acc_t*>(o), rd / 2, a.interleaved);
      } else {
        load(x, iv[t].sd, rd, xbuf);
        rotate(xbuf, c, ss, obuf, rd / 2, a.interleaved);
        store(obuf, rd, o, a.ov[t].sd);
      }
      if (!in_place) {
        for (int64_t j = rd; j < g.D[t]; ++j) {
          o[j * a.ov[t].sd] = x[j * iv[t].sd];
        }
      }
    }
  }
}

struct CpuKernels {
  static constexpr c10::DeviceType device = c10::DeviceType::CPU;

  struct NoGuard {};
  static NoGuard guard(const at::Tensor& /*q*/) { return {}; }

  static int64_t grain(const RotaryGeometry& g) {
    const int64_t per_row = std::max<int64_t>(
        1, g.H[0] * g.D[0] + g.H[1] * g.D[1]);
    return std::max<int64_t>(1, kRotaryGrain / per_row);
  }

  template <typename scalar_t>
  static void forward(const RotaryArgs<scalar_t>& a) {
    using acc_t = at::opmath_type<scalar_t>;
    const RotaryGeometry& g = a.g;
    const int64_t rd = g.rd;
    if (a.pos != nullptr) {
      // The in-place op: every position is checked before anything is
      // written, so a bad one leaves q and k as they were.
      for (int64_t b = 0; b < g.B; ++b) {
        for (int64_t s = 0; s < g.S; ++s) {
          const int64_t p = a.pos[b * a.pb + s * a.ps];
          TORCH_CHECK(p >= 0 && p < a.max_pos, "torchops.rotary_embedding_: "
                      "expected every entry of 'positions' to be in [0, ",
                      a.max_pos, ") (the rows of 'cos_sin_cache'), but got ", p);
        }
      }
    }
    parallel_range(g.B * g.S, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> buf(4 * rd);
      acc_t* c = buf.data();
      acc_t* ss = c + rd;
      acc_t* xbuf = ss + rd;
      acc_t* obuf = xbuf + rd;
      for (int64_t row = begin; row < end; ++row) {
        const int64_t b = row / g.S, s = row % g.S;
        if (a.pos != nullptr) {
          cache_coefficients(a, a.pos[b * a.pb + s * a.ps], c, ss, xbuf);
        } else {
          hf_coefficients(a, b, s, /*transpose=*/false, c, ss, xbuf);
        }
        rotate_row(a, a.x, a.xv, b, s, c, ss, xbuf, obuf);
      }
    }, grain(g));
  }

  template <typename scalar_t>
  static void backward(const RotaryArgs<scalar_t>& a) {
    using acc_t = at::opmath_type<scalar_t>;
    const RotaryGeometry& g = a.g;
    const int64_t rd = g.rd, h = rd / 2;
    const bool shared = g.Bc == 1;  // cos rows summed over the batch too
    const int64_t batches = shared ? g.B : 1;
    parallel_range(g.Bc * g.S, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> buf(6 * rd);
      acc_t* c = buf.data();
      acc_t* ss = c + rd;
      acc_t* xbuf = ss + rd;
      acc_t* obuf = xbuf + rd;
      acc_t* acc_c = obuf + rd;
      acc_t* acc_s = acc_c + rd;
      for (int64_t grp = begin; grp < end; ++grp) {
        const int64_t bc = grp / g.S, s = grp % g.S;
        hf_coefficients(a, bc, s, /*transpose=*/true, c, ss, xbuf);
        std::fill(acc_c, acc_c + 2 * rd, acc_t(0));
        for (int64_t i = 0; i < batches; ++i) {
          const int64_t b = shared ? i : bc;
          rotate_row(a, a.dy, a.dyv, b, s, c, ss, xbuf, obuf);
          if (a.dcos == nullptr) {
            continue;
          }
          for (int t = 0; t < 2; ++t) {
            for (int64_t hd = 0; hd < g.H[t]; ++hd) {
              // The gradient just written is re-read from the output
              // gradient: obuf holds only the last head's.
              const scalar_t* dyp = a.dy[t] + b * a.dyv[t].sb +
                                    s * a.dyv[t].ss + hd * a.dyv[t].sh;
              const scalar_t* xp = a.x[t] + b * a.xv[t].sb + s * a.xv[t].ss +
                                   hd * a.xv[t].sh;
              const acc_t* dyf = obuf;
              const acc_t* xf = xbuf;
              if (std::is_same_v<scalar_t, acc_t> && a.dyv[t].sd == 1) {
                dyf = reinterpret_cast<const acc_t*>(dyp);
              } else {
                load(dyp, a.dyv[t].sd, rd, obuf);
              }
              if (std::is_same_v<scalar_t, acc_t> && a.xv[t].sd == 1) {
                xf = reinterpret_cast<const acc_t*>(xp);
              } else {
                load(xp, a.xv[t].sd, rd, xbuf);
              }
              accumulate(dyf, xf, acc_c, acc_s, h, a.interleaved);
            }
          }
        }
        if (a.dcos != nullptr) {
          for (int64_t j = 0; j < rd; ++j) {
            const acc_t sgn = is_a(j, h, a.interleaved) ? acc_t(-1) : acc_t(1);
            a.dcos[grp * rd + j] = static_cast<scalar_t>(acc_c[j]);
            a.dsin[grp * rd + j] = static_cast<scalar_t>(sgn * acc_s[j]);
          }
        }
      }
    }, std::max<int64_t>(1, grain(g) / std::max<int64_t>(1, batches)));
  }
};

}  // namespace

TORCHOPS_REGISTER_ROTARY(CPU, CpuKernels)

}  // namespace torchops::cpu
