// Rotated-box geometry and argument checks shared by box_iou_rotated,
// nms_rotated and batched_nms_rotated on CPU and CUDA.
//
// A box is a row (x_ctr, y_ctr, width, height, angle), the angle in degrees,
// counter-clockwise in image coordinates (y pointing down): detectron2's
// convention.  Its corners are ctr +- (w/2) u +- (h/2) v with
// u = (cos a, -sin a) and v = (sin a, cos a).  IoU is invariant under a
// reflection of both boxes, so a clockwise convention gives the same IoUs.
//
// Precision: all geometry runs in double whatever the boxes' dtype, and the
// corners of both boxes are taken relative to the first box's centre.  The
// intersection area is a sum of cross products of vertex coordinates
// (shoelace); with absolute coordinates of an aerial image (1e4 pixels) in
// float32 that sum would lose the overlap of small boxes to cancellation,
// while centred coordinates in double keep about 1e-12 relative accuracy.
// Double costs little here: the CPU loop is scalar either way (clipping does
// not vectorise) and the GPU's work per pair is dominated by control flow.
//
// The intersection is exact convex clipping (Sutherland-Hodgman): the first
// box's quadrilateral clipped by the four half-planes of the second's edges.
// Each clip adds at most one vertex to a convex polygon, so 8 vertices
// suffice in exact arithmetic; the buffers hold kMaxClipVertices and every
// write is bounds-checked, so rounding on near-degenerate input can never
// overflow them.  Boxes whose width or height is not > 0 (zero, negative or
// NaN) have IoU 0 with every box, never NaN.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>

#include "common/boxes.h"

namespace torchops {

constexpr int kMaxClipVertices = 16;

// A box prepared once for many IoU tests: centre, half extents, the axis
// (cos, sin), and the radius of its circumscribed circle.
struct RotatedBox {
  double x, y, hw, hh, c, s, r;
};

template <typename scalar_t>
C10_HOST_DEVICE inline RotatedBox prepare_rotated_box(const scalar_t* row,
                                                      int64_t stride) {
  constexpr double kRadPerDegree = 0.017453292519943295;  // pi / 180
  RotatedBox b;
  b.x = static_cast<double>(row[0]);
  b.y = static_cast<double>(row[stride]);
  b.hw = 0.5 * static_cast<double>(row[2 * stride]);
  b.hh = 0.5 * static_cast<double>(row[3 * stride]);
  const double a = static_cast<double>(row[4 * stride]) * kRadPerDegree;
  b.c = std::cos(a);
  b.s = std::sin(a);
  b.r = std::sqrt(b.hw * b.hw + b.hh * b.hh);
  return b;
}

struct Point2 {
  double x, y;
};

// Corners of `b` in counter-clockwise order (positive signed area), relative
// to the point (ox, oy).
C10_HOST_DEVICE inline void rotated_corners(const RotatedBox& b, double ox,
                                            double oy, Point2* p) {
  const double ux = b.hw * b.c, uy = -b.hw * b.s;  // (w/2) u
  const double vx = b.hh * b.s, vy = b.hh * b.c;   // (h/2) v
  const double cx = b.x - ox, cy = b.y - oy;
  p[0] = {cx - ux - vx, cy - uy - vy};
  p[1] = {cx + ux - vx, cy + uy - vy};
  p[2] = {cx + ux + vx, cy + uy + vy};
  p[3] = {cx - ux + vx, cy - uy + vy};
}

// Clips the polygon in[0, n) to the half-plane left of the directed edge
// p -> q (where a counter-clockwise polygon's inside is); returns the
// vertex count written to `out`.
C10_HOST_DEVICE inline int clip_to_half_plane(const Point2* in, int n,
                                              Point2 p, Point2 q,
                                              Point2* out) {
  const double ex = q.x - p.x, ey = q.y - p.y;
  int m = 0;
  for (int i = 0; i < n; ++i) {
    const Point2 a = in[i];
    const Point2 b = in[i + 1 == n ? 0 : i + 1];
    const double da = ex * (a.y - p.y) - ey * (a.x - p.x);
    const double db = ex * (b.y - p.y) - ey * (b.x - p.x);
    const bool a_in = da >= 0.0;
    if (a_in && m < kMaxClipVertices) {
      out[m++] = a;
    }
    // The edge crosses the line: da and db have opposite signs, so
    // da - db is nonzero and t lies in [0, 1].
    if (a_in != (db >= 0.0) && m < kMaxClipVertices) {
      const double t = da / (da - db);
      out[m++] = {a.x + t * (b.x - a.x), a.y + t * (b.y - a.y)};
    }
  }
  return m;
}

// Whether the boxes' circumscribed circles meet.  When they do not, the
// boxes do not overlap: the common case in a sparse scene, decided without
// clipping.
C10_HOST_DEVICE inline bool rotated_circles_meet(const RotatedBox& a,
                                                 const RotatedBox& b) {
  const double dx = b.x - a.x, dy = b.y - a.y;
  const double reach = a.r + b.r;
  return !(dx * dx + dy * dy > reach * reach);
}

// Intersection-over-union of two rotated boxes, in double.
C10_HOST_DEVICE inline double rotated_iou(const RotatedBox& a,
                                          const RotatedBox& b) {
  if (!(a.hw > 0.0 && a.hh > 0.0 && b.hw > 0.0 && b.hh > 0.0)) {
    return 0.0;
  }
  if (!rotated_circles_meet(a, b)) {
    return 0.0;
  }
  Point2 buf0[kMaxClipVertices];
  Point2 buf1[kMaxClipVertices];
  Point2 clip[4];
  rotated_corners(a, a.x, a.y, buf0);
  rotated_corners(b, a.x, a.y, clip);
  Point2* cur = buf0;
  Point2* next = buf1;
  int n = 4;
  for (int e = 0; e < 4 && n > 0; ++e) {
    n = clip_to_half_plane(cur, n, clip[e], clip[(e + 1) & 3], next);
    Point2* t = cur;
    cur = next;
    next = t;
  }
  double twice_area = 0.0;
  for (int i = 0; i < n; ++i) {
    const Point2 p = cur[i];
    const Point2 q = cur[i + 1 == n ? 0 : i + 1];
    twice_area += p.x * q.y - p.y * q.x;
  }
  const double area_a = 4.0 * a.hw * a.hh;
  const double area_b = 4.0 * b.hw * b.hh;
  // Rounding can leave a sliver of negative area, or a hair more than the
  // smaller box: keep the IoU in [0, 1].
  const double inter =
      min_of(max_of(0.5 * twice_area, 0.0), min_of(area_a, area_b));
  return inter / (area_a + area_b - inter);
}

// --- argument checks --------------------------------------------------------

// `x` is a floating (K, 5) tensor of rotated boxes.
inline void check_rotated_boxes(const char* op, Arg x) {
  check_floating(op, x);
  TORCH_CHECK(
      x.t.dim() == 2 && x.t.size(1) == 5, "torchops.", op, ": expected '",
      x.name, "' to have shape (N, 5) (one box (x_ctr, y_ctr, width, height, "
      "angle) per row), but got shape ", x.t.sizes());
}

inline void check_box_iou_rotated(const at::Tensor& boxes1,
                                  const at::Tensor& boxes2,
                                  c10::DeviceType device) {
  const char* op = "box_iou_rotated";
  check_devices(op, device, {{boxes1, "boxes1"}, {boxes2, "boxes2"}});
  check_rotated_boxes(op, {boxes1, "boxes1"});
  check_rotated_boxes(op, {boxes2, "boxes2"});
  check_same_dtype(op, {boxes1, "boxes1"}, {boxes2, "boxes2"});
}

}  // namespace torchops
