"""Models: plain ``nn.Module`` networks, and the LightningModule that trains any of them."""
