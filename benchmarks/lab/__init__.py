"""One-question experiments: each measured one choice of the product, kernel by kernel; the answers are dated in
docs/lab/ (the product's own figures come from the scripts one folder up). ``kernel_cli`` is their shared frame."""
