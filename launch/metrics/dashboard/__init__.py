"""Expert load-balance dashboard: metrics.jsonl of one or more runs -> one offline HTML page (plotly.js inlined)."""
