// Parallel loops over the (RoI, channel) pairs of the RoI pooling kernels.
//
// Plane-major order -- a thread takes whole (image, channel) planes of the
// input and handles every RoI of that image on it -- reads each plane from
// memory once instead of once per RoI, and, because each plane is touched
// by one thread, RoI after RoI in index order, makes accumulation into a
// plane deterministic whatever the number of threads.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace torchops::cpu {

// RoIs of each image, in index order (batch indices already validated).
inline std::vector<std::vector<int64_t>> rois_by_image(
    const std::vector<int64_t>& roi_image, int64_t n_images) {
  std::vector<std::vector<int64_t>> out(static_cast<size_t>(n_images));
  for (size_t i = 0; i < roi_image.size(); ++i) {
    out[static_cast<size_t>(roi_image[i])].push_back(static_cast<int64_t>(i));
  }
  return out;
}

// The image of each RoI, from per-RoI records with a `batch` member.
template <typename Roi>
std::vector<int64_t> images_of(const std::vector<Roi>& rois) {
  std::vector<int64_t> out(rois.size());
  for (size_t i = 0; i < rois.size(); ++i) {
    out[i] = rois[i].batch;
  }
  return out;
}

// Pairs per parallel chunk, for pairs costing `cost` elementary steps.
inline int64_t roi_grain(int64_t cost) {
  return std::max<int64_t>(1, 4096 / std::max<int64_t>(1, cost));
}

// f(roi, channel) for every pair; each (image, channel) plane is handled by
// one thread, its RoIs in index order.
template <typename F>
void parallel_over_planes(const std::vector<int64_t>& roi_image,
                          int64_t n_images, int64_t channels, int64_t cost,
                          const F& f) {
  if (roi_image.empty() || n_images * channels == 0) {
    return;
  }
  const auto by_image = rois_by_image(roi_image, n_images);
  const int64_t per_image =
      std::max<int64_t>(1, static_cast<int64_t>(roi_image.size()) / n_images);
  at::parallel_for(0, n_images * channels,
                   std::max<int64_t>(1, roi_grain(cost) / per_image),
                   [&](int64_t begin, int64_t end) {
    for (int64_t bc = begin; bc < end; ++bc) {
      const int64_t c = bc % channels;
      for (const int64_t i : by_image[static_cast<size_t>(bc / channels)]) {
        f(i, c);
      }
    }
  });
}

// f(roi, channel) for every pair, in any order: plane-major when there are
// enough planes to keep the threads busy, else split over the pairs.
template <typename F>
void parallel_over_roi_channels(const std::vector<int64_t>& roi_image,
                                int64_t n_images, int64_t channels,
                                int64_t cost, const F& f) {
  if (n_images * channels >= 4 * at::get_num_threads()) {
    parallel_over_planes(roi_image, n_images, channels, cost, f);
    return;
  }
  const int64_t pairs = static_cast<int64_t>(roi_image.size()) * channels;
  if (pairs == 0) {
    return;
  }
  at::parallel_for(0, pairs, roi_grain(cost), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      f(i / channels, i % channels);
    }
  });
}

}  // namespace torchops::cpu
