"""Full VMs: QEMU q35 booting a disk image, with a display to screenshot and input to send."""
