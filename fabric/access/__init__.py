"""Who may do what: principals (a token's hash or an mTLS identity), verbs granted on adapter-id prefixes."""
