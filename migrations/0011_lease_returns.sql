-- What a lease gave back: tokens its agent left unspent at the lease's end and will never spend,
-- taken back by the allocator while the lease's window was the pool's current one (grantable again
-- in it). A final report's unspent tokens less these are stranded. 0 for every lease before.
ALTER TABLE lease_spend ADD COLUMN returned BIGINT NOT NULL DEFAULT 0;
ALTER TABLE window_amounts ADD COLUMN returned BIGINT NOT NULL DEFAULT 0;
