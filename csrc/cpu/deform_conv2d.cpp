// CPU kernels of torchops.deform_conv2d and its backward.
//
// Forward, per chunk of images (csrc/common/deform_gemm.h): a deformable
// im2col builds the columns -- each entry the masked bilinear sample of one
// input channel at one kernel tap's shifted position -- and one GEMM per
// weight group, over the whole chunk, multiplies them by the weight.  The
// sampling geometry depends on the offset group, kernel tap and output
// pixel, not on the channel: the im2col computes it for a block of pixels
// at a time and reuses it for every channel of the offset group, writing
// contiguous runs of a column row.
//
// Backward, per chunk: grad_columns = weight^T @ grad and grad_weight +=
// grad @ columns^T (GEMMs); the offset and mask gradients reduce
// grad_columns over each offset group's channels (each output element owned
// by one task); the input gradient scatters grad_columns into the input
// planes, each plane owned by one task.  No atomics: the result is
// deterministic and independent of the thread count.
//
// Half types are computed in float32 (inputs converted once, results rounded
// once at the end).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <type_traits>

#include "common/accumulate.h"
#include "common/deform_conv2d.h"
#include "common/deform_conv2d_steps.h"
#include "common/deform_gemm.h"
#include "cpu/common/parallel.h"

namespace torchops::cpu {
namespace {

// Output pixels whose sampling geometry a task computes at once (kept in
// L1 while it walks the channels).
constexpr int64_t kPixelBlock = 64;

// The chunk of images [n0, n0 + B) a kernel works on: its inputs and where
// sample (og, k, b, p) lives in a (C * K, B * P) column matrix.  The input
// planes are padded with zeros, one row above and below, one column left
// and two right, (H + 2) x (W + 3): every corner of a sample that reads
// anything lies in the padded plane, a corner outside the image reads a
// border zero (never a pixel times a zero weight, which would let a NaN
// through), and a sample that reads nothing reads the 2 x 2 block of zeros
// at the right end of the first two rows.  The inner loops need no branch.
template <typename T>
struct Chunk {
  DeformGeometry g;
  int64_t images;                       // B
  const T* padded;                      // (B, C, H + 2, W + 3)
  const T* offset;                      // (B, 2 * OG * K, P)
  const T* mask;                        // (B, OG * K, P), or nullptr
  int64_t taps() const { return g.taps(); }
  int64_t pixels() const { return g.pixels(); }
  int64_t row() const { return g.width + 3; }
  // Padded index of the all-zero 2 x 2 block.
  int64_t nowhere() const { return g.width + 1; }
  int64_t plane() const { return (g.height + 2) * row(); }
  const T* offset_of(int64_t b) const {
    return offset + b * 2 * g.offset_groups * taps() * pixels();
  }
  const T* mask_of(int64_t b) const {
    return mask != nullptr ? mask + b * g.offset_groups * taps() * pixels()
                           : nullptr;
  }
  // Start of column row (c, k), image b.
  int64_t column(int64_t c, int64_t k, int64_t b) const {
    return ((c * taps() + k) * images + b) * pixels();
  }
};

// Calls f(og, k, b, p0, p1) for every block of pixels [p0, p1) of every
// (offset group, tap, image), in parallel.
template <typename F>
void for_pixel_blocks(const DeformGeometry& g, int64_t images, F&& f) {
  const int64_t P = g.pixels(), K = g.taps();
  const int64_t blocks = (P + kPixelBlock - 1) / kPixelBlock;
  const int64_t tasks = g.offset_groups * K * images * blocks;
  // A task walks group_channels() channels of kPixelBlock pixels.
  const int64_t grain = std::max<int64_t>(
      1, kElementwiseGrain / (kPixelBlock * std::max<int64_t>(1, g.group_channels())));
  parallel_range(tasks, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t blk = t % blocks;
      const int64_t b = (t / blocks) % images;
      const int64_t k = (t / (blocks * images)) % K;
      const int64_t og = t / (blocks * images * K);
      const int64_t p0 = blk * kPixelBlock;
      f(og, k, b, p0, std::min(P, p0 + kPixelBlock));
    }
  }, grain);
}

// The geometry of a block of samples, one array per quantity: corner c of
// pixel p is at padded index base[p] + corner_offset[c].
template <typename T>
struct BlockTaps {
  int64_t n;
  int32_t base[kPixelBlock];  // padded planes fit int32 (deform_conv2d checks)
  T w[4][kPixelBlock];
  T dy[4][kPixelBlock];
  T dx[4][kPixelBlock];
  T m[kPixelBlock];
  bool inside[kPixelBlock];
  int64_t corner[4];

  // with_mask: fold the mask into w (col2im's weights).
  void fill(const Chunk<T>& ch, int64_t og, int64_t k, int64_t b, int64_t p0,
            int64_t p1, bool with_mask) {
    const T* off = ch.offset_of(b);
    const T* msk = ch.mask_of(b);
    const int64_t row = ch.row();
    corner[0] = 0;
    corner[1] = 1;
    corner[2] = row;
    corner[3] = row + 1;
    n = p1 - p0;
    for (int64_t i = 0; i < n; ++i) {
      DeformTaps<T> t;
      inside[i] = deform_sample(ch.g, off, msk, og, k, p0 + i, t, m[i]);
      // Out of range: all weights 0, reading zeros.
      base[i] = static_cast<int32_t>(inside[i] ? (t.y0 + 1) * row + (t.x0 + 1)
                                               : ch.nowhere());
      const T scale = with_mask ? m[i] : T(1);
      for (int c = 0; c < 4; ++c) {
        w[c][i] = t.w[c] * scale;
        dy[c][i] = t.dy[c];
        dx[c][i] = t.dx[c];
      }
    }
  }
};

// The inner loops take NC channels at a time: the block's geometry (base,
// weights) is loaded once for NC planes, which halves the loads per column
// element at NC = 4.  Per destination element the order of the additions
// stays that of one channel at a time, so results do not depend on NC.
constexpr int kChannelStep = 4;

// Calls f(c, std::integral_constant<int, NC>) over channels [c0, c1) in steps
// of kChannelStep, then one by one.
template <typename F>
void for_channel_steps(int64_t c0, int64_t c1, F&& f) {
  int64_t c = c0;
  for (; c + kChannelStep <= c1; c += kChannelStep) {
    f(c, std::integral_constant<int, kChannelStep>{});
  }
  for (; c < c1; ++c) {
    f(c, std::integral_constant<int, 1>{});
  }
}

// dst[q * dst_step + i] = the masked bilinear sample of plane
// src + q * src_step at pixel i of the block, for q < NC (bt filled without
// the mask).  The mask multiplies the interpolated value, as in torchvision:
// folded into the corner weights, an inf mask would meet the zero weights
// of unread corners (0 * inf) and the zero padding, and give NaN where the
// sample is inf.
template <int NC, typename T>
void sample_block(const BlockTaps<T>& bt, const T* __restrict__ src,
                  int64_t src_step, T* __restrict__ dst, int64_t dst_step) {
  const int32_t c2 = static_cast<int32_t>(bt.corner[2]);
  for (int64_t i = 0; i < bt.n; ++i) {
    const int32_t j = bt.base[i];
    const T w0 = bt.w[0][i], w1 = bt.w[1][i], w2 = bt.w[2][i], w3 = bt.w[3][i];
    const T m = bt.m[i];
    for (int q = 0; q < NC; ++q) {
      const T* s = src + q * src_step;
      dst[q * dst_step + i] =
          m * (w0 * s[j] + w1 * s[j + 1] + w2 * s[j + c2] + w3 * s[j + c2 + 1]);
    }
  }
}

// columns[(c, k), (b, p)] for the chunk.
template <typename T>
void deformable_im2col(const Chunk<T>& ch, T* columns) {
  const int64_t cpg = ch.g.group_channels(), plane = ch.plane();
  const int64_t row_step = ch.taps() * ch.images * ch.pixels();
  for_pixel_blocks(ch.g, ch.images, [&](int64_t og, int64_t k, int64_t b,
                                        int64_t p0, int64_t p1) {
    BlockTaps<T> bt;
    bt.fill(ch, og, k, b, p0, p1, /*with_mask=*/false);
    for_channel_steps(og * cpg, (og + 1) * cpg, [&](int64_t c, auto nc) {
      sample_block<decltype(nc)::value>(
          bt, ch.padded + (b * ch.g.channels + c) * plane, plane,
          columns + ch.column(c, k, b) + p0, row_step);
    });
  });
}

// acc_m, acc_y, acc_x[i] += the products of grad_columns with the sample's
// value and its derivatives along y and x, over NC channels in order.
template <int NC, typename T>
void coordinate_block(const BlockTaps<T>& bt, const T* __restrict__ src,
                      int64_t src_step, const T* __restrict__ gc,
                      int64_t gc_step, T* acc_m, T* acc_y, T* acc_x) {
  const int32_t c2 = static_cast<int32_t>(bt.corner[2]);
  for (int64_t i = 0; i < bt.n; ++i) {
    if (!bt.inside[i]) {
      continue;
    }
    const int32_t j = bt.base[i];
    T w[4], dy[4], dx[4];
    for (int q = 0; q < 4; ++q) {
      w[q] = bt.w[q][i];
      dy[q] = bt.dy[q][i];
      dx[q] = bt.dx[q][i];
    }
    T am = acc_m[i], ay = acc_y[i], ax = acc_x[i];
    for (int q = 0; q < NC; ++q) {
      const T* s = src + q * src_step;
      const T v[4] = {s[j], s[j + 1], s[j + c2], s[j + c2 + 1]};
      const T g = gc[q * gc_step + i];
      am += g * deform_dot(w, v);
      ay += g * deform_dot(dy, v);
      ax += g * deform_dot(dx, v);
    }
    acc_m[i] = am;
    acc_y[i] = ay;
    acc_x[i] = ax;
  }
}

// grad_offset and grad_mask of the chunk's images from grad_columns.
template <typename T>
void coordinate_grads(const Chunk<T>& ch, const T* grad_columns,
                      T* grad_offset, T* grad_mask) {
  const int64_t cpg = ch.g.group_channels(), plane = ch.plane();
  const int64_t K = ch.taps(), P = ch.pixels(), OG = ch.g.offset_groups;
  const int64_t row_step = K * ch.images * P;
  for_pixel_blocks(ch.g, ch.images, [&](int64_t og, int64_t k, int64_t b,
                                        int64_t p0, int64_t p1) {
    BlockTaps<T> bt;
    bt.fill(ch, og, k, b, p0, p1, /*with_mask=*/false);
    T acc_y[kPixelBlock] = {}, acc_x[kPixelBlock] = {}, acc_m[kPixelBlock] = {};
    for_channel_steps(og * cpg, (og + 1) * cpg, [&](int64_t c, auto nc) {
      coordinate_block<decltype(nc)::value>(
          bt, ch.padded + (b * ch.g.channels + c) * plane, plane,
          grad_columns + ch.column(c, k, b) + p0, row_step, acc_m, acc_y, acc_x);
    });
    T* go = grad_offset + b * 2 * OG * K * P + (og * K + k) * 2 * P;
    for (int64_t i = 0; i < bt.n; ++i) {
      go[p0 + i] = acc_y[i] * bt.m[i];
      go[P + p0 + i] = acc_x[i] * bt.m[i];
    }
    if (grad_mask != nullptr) {
      T* gm = grad_mask + b * OG * K * P + (og * K + k) * P;
      for (int64_t i = 0; i < bt.n; ++i) {
        gm[p0 + i] = acc_m[i];
      }
    }
  });
}

// dst + q * dst_step (a padded plane) += the bilinear scatter of
// gc[q * gc_step + i] for the block's pixels, q < NC.
template <int NC, typename T>
void scatter_block(const BlockTaps<T>& bt, const T* __restrict__ gc,
                   int64_t gc_step, T* __restrict__ dst, int64_t dst_step) {
  const int32_t c2 = static_cast<int32_t>(bt.corner[2]);
  for (int64_t i = 0; i < bt.n; ++i) {
    if (!bt.inside[i]) {
      continue;
    }
    const int32_t j = bt.base[i];
    const T w0 = bt.w[0][i], w1 = bt.w[1][i], w2 = bt.w[2][i], w3 = bt.w[3][i];
    for (int q = 0; q < NC; ++q) {
      T* d = dst + q * dst_step;
      const T g = gc[q * gc_step + i];
      d[j] += g * w0;
      d[j + 1] += g * w1;
      d[j + c2] += g * w2;
      d[j + c2 + 1] += g * w3;
    }
  }
}

// Adds the bilinear scatter of grad_columns into `grad_padded`, the chunk's
// input gradient as zero-initialised padded planes (what lands on the
// border is dropped by the caller).  Each task owns a few channel planes of
// one image and adds into them in (tap, pixel) order, whatever the thread
// count; channels of one offset group share the geometry, computed once per
// block of pixels for the task's planes.
template <typename T>
void deformable_col2im(const Chunk<T>& ch, const T* grad_columns,
                       T* grad_padded) {
  const int64_t cpg = ch.g.group_channels(), plane = ch.plane();
  const int64_t K = ch.taps(), P = ch.pixels(), OG = ch.g.offset_groups;
  const int64_t B = ch.images, row_step = K * B * P;
  // Enough tasks for every thread (4 each), as few as that allows: each
  // recomputes the geometry of its image and offset group.
  const int64_t want = 4 * at::get_num_threads();
  const int64_t split = std::min<int64_t>(
      cpg, std::max<int64_t>(1, (want + B * OG - 1) / (B * OG)));
  const int64_t per_task = (cpg + split - 1) / split;
  parallel_range(B * OG * split, [&](int64_t begin, int64_t end) {
    BlockTaps<T> bt;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t s = t % split, og = (t / split) % OG, b = t / (split * OG);
      const int64_t c0 = og * cpg + s * per_task;
      const int64_t c1 = std::min(og * cpg + cpg, c0 + per_task);
      for (int64_t k = 0; k < K; ++k) {
        for (int64_t p0 = 0; p0 < P; p0 += kPixelBlock) {
          bt.fill(ch, og, k, b, p0, std::min(P, p0 + kPixelBlock),
                  /*with_mask=*/true);
          for_channel_steps(c0, c1, [&](int64_t c, auto nc) {
            scatter_block<decltype(nc)::value>(
                bt, grad_columns + ch.column(c, k, b) + p0, row_step,
                grad_padded + (b * ch.g.channels + c) * plane, plane);
          });
        }
      }
    }
  }, 1);
}

// The padded planes are indexed with int32 (see sample_block).
void check_padded_plane(const char* op, const DeformConvSizes& s) {
  TORCH_CHECK((s.height + 2) * (s.width + 3) < (int64_t(1) << 31), "torchops.",
              op, ": 'input' planes of ", s.height, " x ", s.width,
              " pixels are too large for the CPU kernel (at most 2^31)");
}

template <typename T>
Chunk<T> chunk_of(const DeformChunkTensors& c) {
  return Chunk<T>{c.g, c.images, c.input.const_data_ptr<T>(),
                  c.offset.const_data_ptr<T>(),
                  c.g.use_mask ? c.mask.const_data_ptr<T>() : nullptr};
}

// The steps of common/deform_conv2d_steps.h, on the CPU.
struct CpuKernels {
  static constexpr c10::DeviceType device = c10::DeviceType::CPU;

  struct Prepared {};
  static Prepared prepare(const char* op, const DeformConvSizes& s,
                          const at::Tensor& /*input*/) {
    check_padded_plane(op, s);
    return {};
  }

  static at::ScalarType compute_type(at::ScalarType dtype) {
    return accumulate_type(dtype);
  }

  // The chunk's input planes with their border of zeros (see Chunk).
  static at::Tensor chunk_input(const at::Tensor& in, int64_t n0,
                                int64_t images) {
    return at::constant_pad_nd(in.narrow(0, n0, images), {1, 2, 1, 1}, 0);
  }

  template <typename Name>
  static void im2col(const DeformChunkTensors& c, const at::Tensor& cols) {
    AT_DISPATCH_FLOATING_TYPES(cols.scalar_type(), Name::value, [&] {
      deformable_im2col(chunk_of<scalar_t>(c), cols.mutable_data_ptr<scalar_t>());
    });
  }

  static at::Tensor grad_bias(const at::Tensor& /*grad*/, const at::Tensor& go,
                              at::ScalarType /*acc*/) {
    return go.sum(at::IntArrayRef{0, 2});
  }

  static int64_t column_copies(at::ScalarType /*ct*/, const DeformGemm& /*d*/,
                               int64_t /*batch*/) {
    return 1;
  }

  static int64_t forward_column_rows(at::ScalarType /*ct*/, const DeformGemm& d,
                                     int64_t /*batch*/) {
    return d.column_rows;
  }

  static void forward_chunk(const DeformChunkTensors& c, const DeformGemm& d,
                            at::Tensor& out3, int64_t n0, int64_t images,
                            const at::Tensor& weight, const at::Tensor& cols,
                            const at::Tensor& bias, at::Tensor& scratch) {
    im2col<DeformForwardName>(c, cols);
    deform_forward_gemm(d, out3, n0, images, weight, cols, bias, scratch);
  }

  static void backward_gemm(const DeformGemm& d, const at::Tensor& grad3,
                            int64_t n0, int64_t images, const at::Tensor& weight,
                            const at::Tensor& columns, at::Tensor& grad_columns,
                            at::Tensor& grad_weight) {
    deform_backward_gemm(d, grad3, n0, images, weight, columns, grad_columns,
                         grad_weight);
  }

  static bool gathers_input_grad(bool /*deterministic*/,
                                const DeformGeometry& /*g*/) {
    return false;
  }

  // The chunk's input gradient as padded planes (what lands on the border
  // is dropped).
  static at::Tensor col2im_buffer(int64_t chunk, const DeformConvSizes& s,
                                  const at::TensorOptions& opts) {
    return at::empty({chunk, s.channels, s.height + 2, s.width + 3}, opts);
  }

  static void input_grads(const DeformChunkTensors& c, const at::Tensor& gcols,
                          at::Tensor grad_offset, at::Tensor grad_mask,
                          at::Tensor grad_input, at::Tensor& grad_padded,
                          bool /*gathered*/) {
    grad_padded.zero_();
    AT_DISPATCH_FLOATING_TYPES(gcols.scalar_type(), DeformBackwardName::value, [&] {
      using T = scalar_t;
      const Chunk<T> ch = chunk_of<T>(c);
      const T* gcp = gcols.const_data_ptr<T>();
      coordinate_grads(ch, gcp, grad_offset.mutable_data_ptr<T>(),
                       grad_mask.defined() ? grad_mask.mutable_data_ptr<T>() : nullptr);
      deformable_col2im(ch, gcp, grad_padded.mutable_data_ptr<T>());
    });
    const int64_t B = c.images, H = c.g.height, W = c.g.width;
    grad_input.copy_(grad_padded.narrow(0, 0, B).narrow(2, 1, H).narrow(3, 1, W));
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(torchops, CPU, m) {
  m.impl("deform_conv2d", &deform_conv2d_forward<CpuKernels>);
  m.impl("_deform_conv2d_backward", &deform_conv2d_backward<CpuKernels>);
}

}  // namespace torchops::cpu
