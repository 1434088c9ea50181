"""CPU and GPU model plumbing: loading (hub, folder, bundled package), placement and device maps, fit, the EAGLE-3 head
(its format in eagle3, its module in eagle3_head), CPU kernels."""
