use super::*;

#[test]
fn rfc3339_renders_utc_with_milliseconds() {
    assert_eq!(rfc3339_ms(0), "1970-01-01T00:00:00.000Z");
    assert_eq!(rfc3339_ms(1_764_547_200_123_000_000), "2025-12-01T00:00:00.123Z");
    assert_eq!(rfc3339_ms(951_782_400_000_000_000), "2000-02-29T00:00:00.000Z");
}

#[test]
fn the_first_binding_level_is_named_in_order() {
    let limits = LevelLimits {
        global: 10,
        tenant: 5,
        project: 3,
    };
    let usage = [
        Usage {
            reserved: 2,
            committed: 0,
        },
        Usage {
            reserved: 2,
            committed: 0,
        },
        Usage {
            reserved: 2,
            committed: 0,
        },
    ];
    assert_eq!(binding_level(&usage, &limits, 1), None);
    assert_eq!(binding_level(&usage, &limits, 2), Some(Level::Project));
    assert_eq!(binding_level(&usage, &limits, 4), Some(Level::Tenant));
    assert_eq!(binding_level(&usage, &limits, 9), Some(Level::Global));
}
