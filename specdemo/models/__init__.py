"""CPU and GPU model plumbing: loading (hub, folder, bundled package), placement and device maps, fit, the EAGLE-3 head, CPU kernels."""
