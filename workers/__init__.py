"""Expert worker side: expert FFNs, the serve loop and its CLI."""
