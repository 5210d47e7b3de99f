//! The partition of a flow: how several relays split the flow space (SPEC §12). A flow's
//! partition is fixed for ever, so every producer computes it identically at insert, every
//! relay identically when it reads, and the producer schema's upgrade identically in SQL:
//! FNV-1a (32-bit) over the flow id's UTF-8 bytes, modulo [`PARTITIONS`]. Never change
//! either: stored rows carry the value.

/// The number of partitions of the flow space: a relay holds a share of them (at most this
/// many relays can share one outbox usefully).
pub const PARTITIONS: u16 = 64;

/// FNV-1a's 32-bit offset basis and prime.
const FNV_OFFSET: u32 = 2_166_136_261;
const FNV_PRIME: u32 = 16_777_619;

/// The partition of `flow_id`, in `0..PARTITIONS`.
pub fn flow_partition(flow_id: &str) -> u16 {
    let mut hash = FNV_OFFSET;
    for byte in flow_id.as_bytes() {
        hash ^= u32::from(*byte);
        hash = hash.wrapping_mul(FNV_PRIME);
    }
    // The remainder is below PARTITIONS (64), so it fits.
    (hash % u32::from(PARTITIONS)) as u16
}

/// The same function in PL/pgSQL (`flow_partition(text)`, created in the producer schema by
/// its DDL and its upgrade), as a literal for `concat!`: the upgrade computes the partition
/// of rows written before it, and operators can ask which partition a flow is in. `h` stays
/// below 2^32 after the mask, so the product fits in a BIGINT.
#[macro_export]
macro_rules! flow_partition_sql {
    () => {
        r#"
CREATE FUNCTION flow_partition(id TEXT) RETURNS SMALLINT LANGUAGE plpgsql IMMUTABLE STRICT AS $fn$
DECLARE
    b BYTEA := convert_to(id, 'UTF8');
    h BIGINT := 2166136261;
BEGIN
    FOR i IN 0 .. length(b) - 1 LOOP
        h := ((h # get_byte(b, i)) * 16777619) & 4294967295;
    END LOOP;
    RETURN (h % 64)::SMALLINT;
END
$fn$;
"#
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pinned values: a change of the function would move stored flows to other partitions.
    #[test]
    fn partitions_are_pinned() {
        assert_eq!(flow_partition(""), (FNV_OFFSET % 64) as u16);
        let pinned: Vec<u16> =
            ["A", "B", "flow-1", "flow-2", "ünïcode"].iter().map(|f| flow_partition(f)).collect();
        assert_eq!(pinned, [12, 5, 27, 46, 43]);
    }

    #[test]
    fn partitions_spread_over_the_space() {
        let mut seen = [0u32; PARTITIONS as usize];
        for i in 0..6400 {
            seen[flow_partition(&format!("flow-{i}")) as usize] += 1;
        }
        assert!(seen.iter().all(|&n| (50..150).contains(&n)), "{seen:?}");
    }
}
